"""A large budget takes pieces of up to MAX_PIECE_TOKENS (16,384 since session 17, 4,096 from session 8; 512 before,
MOESTREAM_PIECE_TOKENS=512 gives that plan; gpu_worker/prefill.py `span_plan`), a small one grows its pieces only as
far as its longest span and decoded weights allow; large pieces give the logits of small ones, and the launches they
save are counted (bench/launch_count.py). Twins: pieces one step larger than chosen, and a Mamba carry dropped between
pieces."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch

from gpu_worker import prefill as P
from kernels import mamba_scan
from nemotron import mamba
from nemotron.config import NemotronHConfig
from nemotron.model import MAX_PIECE_TOKENS, PIECE_TOKENS, NemotronH
from tools.synth import build_config

BF = torch.bfloat16


def _super(moe_layers=None):
    return NemotronHConfig.from_dict(build_config("super", "nvfp4",
                                                  argparse.Namespace(pattern=None, moe_layers=moe_layers)))


@pytest.fixture(autouse=True)
def _large_pieces(monkeypatch):
    monkeypatch.setenv("MOESTREAM_PIECE_TOKENS", str(MAX_PIECE_TOKENS))


def test_on_by_default_and_512_is_the_old_plan(monkeypatch):
    """Large pieces are the default since session 8's H200 run (16,384 since session 17's); MOESTREAM_PIECE_TOKENS=512
    gives session 6's plan."""
    monkeypatch.delenv("MOESTREAM_PIECE_TOKENS")
    cfg = _super(4)
    assert P.piece_tokens_max() == MAX_PIECE_TOKENS == 16384 and PIECE_TOKENS == 512
    assert P.span_plan(cfg, BF, 60 << 30, "cuda").pieces.tokens == 16384
    monkeypatch.setenv("MOESTREAM_PIECE_TOKENS", "512")
    for budget in (512 << 20, 60 << 30):
        assert P.span_plan(cfg, BF, budget, "cuda") == P._with_dequant(*_old(cfg, budget))
    assert P.span_plan(cfg, BF, 60 << 30, "cuda").pieces.tokens == 512


def _old(cfg, budget):
    """The plan as session 6 made it (pieces of 512 halved by the eighth-of-the-budget rule, then dequant_bound)."""
    plan = P.dequant_bound(cfg, BF, budget, P._plan_from(cfg, BF, budget, "cuda", 512, 512))
    return plan, plan.pieces.dequant_bytes


@pytest.mark.parametrize("moe_layers", [None, 4])
def test_large_budget_takes_large_pieces_small_keeps_its_span(moe_layers):
    cfg = _super(moe_layers)
    big = P.span_plan(cfg, BF, 60 << 30, "cuda")
    assert big.pieces.tokens == big.pieces.mamba_tokens == MAX_PIECE_TOKENS == 16384
    for budget in (512 << 20, 1 << 30, 3 << 29):
        new, old = P.span_plan(cfg, BF, budget, "cuda"), P.span_plan(cfg, BF, budget, "cuda", max_piece=PIECE_TOKENS)
        assert new.pieces.tokens >= old.pieces.tokens and new.pieces.mamba_tokens >= old.pieces.mamba_tokens
        assert P._longest_span(cfg, BF, budget, new) >= P._longest_span(cfg, BF, budget, old)
        assert P.prefill_span(cfg, BF, budget, device="cuda") == P._longest_span(cfg, BF, budget, new)
    # the server's reserve: the old plan was pieces of 512, Mamba 256 (128 when a Mamba piece was priced at the
    # PyTorch path's bytes, before session 12); now 1,024 and 1,024, the same span (9,880 on Super) and the same
    # decoded weights (none at 512 MiB)
    at_512, old = P.span_plan(cfg, BF, 512 << 20, "cuda"), P.span_plan(cfg, BF, 512 << 20, "cuda", max_piece=512)
    assert (old.pieces.tokens, old.pieces.mamba_tokens) == (512, 256)
    assert (at_512.pieces.tokens, at_512.pieces.mamba_tokens) == (1024, 1024)
    assert at_512.pieces.dequant_bytes == old.pieces.dequant_bytes
    assert P.prefill_span(cfg, BF, 512 << 20, device="cuda") == P._longest_span(cfg, BF, 512 << 20, old)
    # at 1 GiB the decoded weights stay held beside the larger pieces
    g1, g1_old = P.span_plan(cfg, BF, 1 << 30, "cuda"), P.span_plan(cfg, BF, 1 << 30, "cuda", max_piece=512)
    assert g1.pieces.dequant_bytes == g1_old.pieces.dequant_bytes > 0


def test_twins_one_step_larger_shorten_the_span():
    """Must-fail twins: at the server's 512 MiB, the pieces one step larger than chosen (Mamba 512, or the others
    2,048), or 16,384 everywhere, would shorten the span: the search stops where it must."""
    cfg, budget = _super(), 512 << 20
    kept = P.span_plan(cfg, BF, budget, "cuda")
    p = kept.pieces
    longest = P._longest_span(cfg, BF, budget, kept)
    for tokens, mamba in ((p.tokens, 2 * p.mamba_tokens), (2 * p.tokens, p.mamba_tokens),
                          (MAX_PIECE_TOKENS, MAX_PIECE_TOKENS)):
        bigger = dataclasses.replace(kept, pieces=P.Pieces(tokens, p.score_bytes, mamba, p.dequant_bytes))
        assert P._longest_span(cfg, BF, budget, bigger) < longest, (tokens, mamba)


def test_env_switch_gives_the_old_plan_and_names_bad_values(monkeypatch):
    cfg = _super(4)
    assert P.span_plan(cfg, BF, 60 << 30, "cuda").pieces.tokens == MAX_PIECE_TOKENS
    monkeypatch.setenv("MOESTREAM_PIECE_TOKENS", "512")
    assert P.span_plan(cfg, BF, 60 << 30, "cuda") == P.span_plan(cfg, BF, 60 << 30, "cuda", max_piece=512)
    assert P.span_plan(cfg, BF, 60 << 30, "cuda").pieces.tokens == 512
    monkeypatch.setenv("MOESTREAM_PIECE_TOKENS", "99999")
    assert P.piece_tokens_max() == MAX_PIECE_TOKENS      # a Mamba mixer cuts longer calls itself
    monkeypatch.setenv("MOESTREAM_PIECE_TOKENS", "4096")      # session 8-16's default
    assert P.span_plan(cfg, BF, 60 << 30, "cuda").pieces.tokens == 4096
    at_512 = P.span_plan(cfg, BF, 512 << 20, "cuda")
    monkeypatch.delenv("MOESTREAM_PIECE_TOKENS")              # a small budget grows its pieces no further than before
    assert at_512 == P.span_plan(cfg, BF, 512 << 20, "cuda")
    for bad in ("lots", "0", "-4"):
        monkeypatch.setenv("MOESTREAM_PIECE_TOKENS", bad)
        with pytest.raises(ValueError, match="MOESTREAM_PIECE_TOKENS"):
            P.piece_tokens_max()


def test_span_bytes_grows_with_the_pieces():
    """The estimate prices the pieces it is given (bench/prefill.py holds it against the device peak): at 16k a
    16,000-token Mamba piece (the default pieces of 16,384) holds its 125 chunks' states."""
    cfg = _super(4)
    big, old = P.span_plan(cfg, BF, 60 << 30, "cuda"), P.span_plan(cfg, BF, 60 << 30, "cuda", max_piece=512)
    t_big, t_old = P.span_terms(cfg, BF, 16000, plan=big), P.span_terms(cfg, BF, 16000, plan=old)
    from kernels.mamba_ssd import ssd_bytes
    assert big.mamba_path == "ssd"       # on CUDA in bf16 the scan runs on the tensor cores
    assert t_big["mamba"] - t_old["mamba"] >= ssd_bytes(16000, 128, 64, 128, 128) - ssd_bytes(512, 128, 64, 128, 128)
    assert P.span_bytes(cfg, BF, 16000, plan=big) >= P.span_bytes(cfg, BF, 16000, plan=old)


@pytest.fixture(scope="module")
def tiny_model(synth):
    return synth("tiny", "nvfp4")


def _prefill(model, ids, piece, monkeypatch):
    monkeypatch.setenv("MOESTREAM_PIECE_TOKENS", str(piece))
    return P.prefill(model, ids, model.new_state(), budget_bytes=1 << 30, all_logits=True)


def test_large_pieces_equal_small_and_a_lost_carry_is_caught(tiny_model, monkeypatch):
    model = NemotronH(tiny_model)
    ids = [int(t) for t in np.random.default_rng(8).integers(14, 1000, size=1100)]
    small, large = _prefill(model, ids, 128, monkeypatch), _prefill(model, ids, 4096, monkeypatch)
    assert P.span_plan(model.config, model.dtype, 1 << 30, model.device).pieces.mamba_tokens == 4096
    torch.testing.assert_close(large, small, rtol=1e-4, atol=1e-4)
    # the twin: each Mamba call starting from a zero state, as if the pieces did not carry it
    real = mamba.chunk_scan
    monkeypatch.setattr(mamba, "chunk_scan", lambda x, dt, A, B, C, S, q: real(x, dt, A, B, C, torch.zeros_like(S), q))
    lost = _prefill(model, ids, 128, monkeypatch)
    assert (lost - small).abs().max() > 1e-2


def test_pieces_above_the_default_equal_it_and_a_lost_carry_is_caught(tiny_model, monkeypatch):
    """The default's 16,384 (one piece for a 4,500-token prompt) gives the logits of session 8-16's 4,096 (two pieces,
    the Mamba state carried between them); the twin drops the carry at the 4,096 cut."""
    model = NemotronH(tiny_model)
    ids = [int(t) for t in np.random.default_rng(9).integers(14, 1000, size=4500)]
    whole, two = _prefill(model, ids, 16384, monkeypatch), _prefill(model, ids, 4096, monkeypatch)
    monkeypatch.setenv("MOESTREAM_PIECE_TOKENS", "16384")
    assert P.span_plan(model.config, model.dtype, 1 << 30, model.device).pieces.mamba_tokens == 16384
    torch.testing.assert_close(whole[-64:], two[-64:], rtol=1e-4, atol=1e-4)
    real = mamba.chunk_scan
    monkeypatch.setattr(mamba, "chunk_scan", lambda x, dt, A, B, C, S, q: real(x, dt, A, B, C, torch.zeros_like(S), q))
    lost = _prefill(model, ids, 4096, monkeypatch)
    assert (lost[-64:] - whole[-64:]).abs().max() > 1e-2


def test_launch_count_falls_with_large_pieces(tmp_path):
    """bench/launch_count.py on the Super pattern (small widths, 2 MoE layers): 2,000 tokens in pieces of 4,096 make
    fewer launches in the Mamba and MoE layers than in pieces of 512, whose Mamba pieces each cost tens of ops."""
    from bench import launch_count
    model = NemotronH(launch_count._model_dir(tmp_path, 2), device="cpu", dtype=torch.float32)
    ids = [(7 * i) % 1000 + 14 for i in range(2000)]
    old, new = launch_count.count(model, ids, 512), launch_count.count(model, ids, 4096)
    assert (old["piece_tokens"], new["piece_tokens"]) == (512, 4096)
    for kind in ("mamba", "moe"):
        assert old["by_kind"][kind]["pieces_per_layer"] == 4 and new["by_kind"][kind]["pieces_per_layer"] == 1
        assert new["by_kind"][kind]["launches"] * 2 < old["by_kind"][kind]["launches"]
    assert old["by_kind"]["experts"]["launches"] == new["by_kind"]["experts"]["launches"] > 0
