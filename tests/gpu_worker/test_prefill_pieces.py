"""A prefill span's per-layer temporaries bounded by a piece of tokens, not by the span: the piecewise MoE layer
equals the whole-span one (each routed expert still run once, on every token of the span), a launch budget too
small for one expert's rows still gives the same logits, and on the Super shape a 512 MiB budget holds a span of
about 10k tokens (869 before). Each check has a twin that breaks the piece boundaries or the windows."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from gpu_worker import prefill_experts, prefill_knobs
import nemotron.moe as moe
from gpu_worker.engine import StreamingEngine
from gpu_worker.prefill import SpanPlan, prefill, prefill_span, span_bytes, span_plan
from nemotron.config import NemotronHConfig
from nemotron.model import NemotronH, Pieces
from nemotron.moe import ExpertSource, MoEMixer
from nemotron.norms import rms_norm
from tests.gpu_worker.test_streaming_pipeline import make_store, tenth_of_experts
from tools.synth import build_config

T_ODD, PIECE = 1023, 100          # the piece does not divide the span
SPAN_AT_512_MIB = 9800            # gpu_worker/prefill.py's model on the Super shape: 9,880 (bench/NOTES.md, h17)


class Counting(ExpertSource):
    """The checkpoint's experts, with every apply() recorded: (rows, the guess it was given)."""
    wants_guess = True

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def apply(self, moe_index, layer, x, experts, weights, guess=None):
        self.calls.append((x.shape[0], None if guess is None else guess.clone()))
        return self.inner.apply(moe_index, layer, x, experts, weights, guess)


@pytest.fixture(scope="module")
def tiny_model(synth):
    return synth("tiny", "nvfp4")


def _moe_layer(model: NemotronH):
    i, m = next((i, m) for i, m in enumerate(model.mixers) if isinstance(m, MoEMixer))
    return m, model.norms[i], model.config.layer_norm_epsilon


def _random_x(model, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, model.config.hidden_size, generator=g) * 0.5


def test_piecewise_moe_equals_whole_span(tiny_model):
    model = NemotronH(tiny_model)
    m, norm, eps = _moe_layer(model)
    m.experts = src = Counting(m.experts)
    x = _random_x(model, T_ODD)
    whole = x + m(rms_norm(x, norm, eps))
    (rows, guess_whole), = src.calls
    src.calls.clear()
    y = x.clone()
    m.add_to(y, norm, eps, PIECE)
    (rows_p, guess_p), = src.calls        # one apply for the whole span: each routed expert read once
    assert rows == rows_p == T_ODD
    assert torch.equal(guess_p, guess_whole) and int(guess_p.sum()) == T_ODD * m.router.k
    torch.testing.assert_close(y, whole, rtol=1e-5, atol=1e-5)


def test_piecewise_moe_twin_dropping_a_row_is_caught(tiny_model, monkeypatch):
    """Must-fail twin: pieces whose ends fall one row short leave those rows without the layer's output."""
    model = NemotronH(tiny_model)
    m, norm, eps = _moe_layer(model)
    x = _random_x(model, T_ODD, seed=1)
    whole = x + m(rms_norm(x, norm, eps))
    right = moe.pieces

    def short(T, size):
        return [(a, b - 1 if b < T else b) for a, b in right(T, size)]
    monkeypatch.setattr(moe, "pieces", short)
    y = x.clone()
    m.add_to(y, norm, eps, PIECE)
    bad = (y - whole).abs().amax(-1) > 1e-3
    assert bad.any(), "a dropped row went unnoticed"
    assert bad.nonzero().flatten().tolist() == [b - 1 for _, b in right(T_ODD, PIECE)[:-1]]


def test_forward_in_small_pieces_equals_large(tiny_model):
    """The whole model: pieces of one scan chunk and attention queries capped to a few score rows against the
    default pieces (the piece size must not change the logits); the twin runs the default with one token less."""
    model = NemotronH(tiny_model)
    ids = [int(t) for t in np.random.default_rng(3).integers(14, 1000, size=T_ODD)]
    ref = model.forward(ids, model.new_state())
    small = model.forward(ids, model.new_state(), pieces=Pieces(tokens=model.config.chunk_size, score_bytes=4096))
    torch.testing.assert_close(small, ref, rtol=1e-4, atol=1e-4)
    shifted = model.forward(ids[1:], model.new_state())
    assert (shifted - ref[1:]).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------ launches
def _streamed_logits(model_dir, store, ids, launch_bytes, monkeypatch):
    monkeypatch.setattr(prefill_knobs, "PREFILL_BATCH_BYTES", launch_bytes)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        out = prefill(eng.model, ids, eng.model.new_state())
        last = eng.experts.prefill_acct.last
        return out, (last.launches, last.distinct_experts), eng.experts.launch_bytes


def test_small_launches_windows_and_gathers_equal_the_checkpoint(tiny_model, tmp_path, monkeypatch):
    """A launch budget below one expert's rows: one expert per launch, its rows in several windows (and the
    hits' rows gathered where they are not contiguous). The logits equal the in-memory engine's; the twin drops a
    window's last row."""
    store = make_store(tiny_model, tmp_path / "store")
    ids = [int(t) for t in np.random.default_rng(4).integers(14, 1000, size=900)]
    ref = prefill(NemotronH(tiny_model), ids, NemotronH(tiny_model).new_state())
    small = 40 << 10
    n_experts, rows = prefill_knobs.launch_limits(1, 64, 96, 4, small)
    assert n_experts == 1 and rows < 900 * 4 // 32, "the budget must split an expert's rows"
    out, (launches, distinct), used = _streamed_logits(tiny_model, store, ids, small, monkeypatch)
    assert used == small and launches > distinct, "no expert's rows were split into windows"
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    right = prefill_experts._windows

    def short(segments, cap):
        return [[(a, n - 1 if n > 1 else n) for a, n in w] for w in right(segments, cap)]
    monkeypatch.setattr(prefill_experts, "_windows", short)
    bad, _, _ = _streamed_logits(tiny_model, store, ids, small, monkeypatch)
    assert (bad - ref).abs().max() > 1e-3, "a dropped row went unnoticed"


# ------------------------------------------------------------------------------------------------ budget
def _super():
    return NemotronHConfig.from_dict(build_config("super", "nvfp4", argparse.Namespace(pattern=None, moe_layers=None)))


def test_super_span_at_512_mib():
    """At the engine's 512 MiB reserve, the Super shape's span is at least SPAN_AT_512_MIB tokens (869 when every
    per-layer temporary was priced per token of the span). The twin prices that span with a large budget's
    pieces and launches (512-token pieces, PREFILL_BATCH_BYTES): it does not fit."""
    cfg, budget = _super(), 512 << 20
    n = prefill_span(cfg, torch.bfloat16, budget)
    plan = span_plan(cfg, torch.bfloat16, budget)
    print(f"Super at 512 MiB: {n} tokens, {plan}")
    assert n >= SPAN_AT_512_MIB
    assert span_bytes(cfg, torch.bfloat16, n, plan=plan) <= budget < span_bytes(cfg, torch.bfloat16, n + 1, plan=plan)
    assert span_bytes(cfg, torch.bfloat16, n, plan=SpanPlan()) > budget
    assert plan.launch() <= budget // 4 and plan.pieces.tokens_for(cfg, mamba=True) % cfg.chunk_size == 0
    # on CUDA attention holds no scores (one fused launch a piece): the MoE layer still decides
    assert prefill_span(cfg, torch.bfloat16, budget, device="cuda") == n


def test_bench_shape_takes_16k_in_one_span_at_512_mib():
    """bench.prefill's Super shape (4 MoE layers, 9 layers): a 16,000-token prompt in one span at 512 MiB (987
    tokens before, issue 13's 4,000-token prompt in 5 spans); the twin, a budget below its estimate, splits it."""
    cfg = NemotronHConfig.from_dict(build_config("super", "nvfp4", argparse.Namespace(pattern=None, moe_layers=4)))
    budget = 512 << 20
    assert prefill_span(cfg, torch.bfloat16, budget, cap=16000) == 16000
    need = span_bytes(cfg, torch.bfloat16, 16000, plan=span_plan(cfg, torch.bfloat16, budget))
    assert need <= budget and prefill_span(cfg, torch.bfloat16, need // 2, cap=16000) < 16000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped Triton launches and the staging ring: CUDA")
@pytest.mark.parametrize("path", ["staged", "zero_copy"])
def test_gpu_small_launches_equal_large(tiny_model, tmp_path, monkeypatch, path):
    """On the GPU (bf16), a launch budget of one expert with its rows in windows (and a ring of two slots) gives the
    logits of the default launches."""
    store = make_store(tiny_model, tmp_path / "store")
    ids = [int(t) for t in np.random.default_rng(6).integers(14, 1000, size=900)]
    outs = []
    for launch in (prefill_knobs.PREFILL_BATCH_BYTES, 40 << 10):
        monkeypatch.setattr(prefill_knobs, "PREFILL_BATCH_BYTES", launch)
        with StreamingEngine(store, model_dir=tiny_model, cache_bytes=tenth_of_experts(store), io_workers=2,
                             device="cuda", dtype=torch.bfloat16) as eng:
            eng.experts.prefill_weights = path
            outs.append(prefill(eng.model, ids, eng.model.new_state()).float().cpu())
            last = eng.experts.prefill_acct.last
            if launch < 1 << 20:
                assert last.launches > last.distinct_experts
    a, b = (torch.log_softmax(o.double(), -1) for o in outs)
    kl = float((a.exp() * (a - b)).sum(-1).mean())
    print(f"{path}: KL small launches vs default {kl:.2e}")
    assert kl < 1e-3 and int(outs[0].argmax()) == int(outs[1].argmax())


def test_launch_gathers_rows_across_gaps(tiny_model, tmp_path, monkeypatch):
    """With the rows sorted by expert id (`MOESTREAM_PREFILL_ROWS_IN_LAUNCH_ORDER=0`) and a cache of a tenth, the hits
    are scattered among the routed experts, so a launch of several hits gathers rows from segments with gaps between
    them: the logits equal the in-memory engine's. The twin re-bases the segments as if there were no gaps (the rows
    of the slice from the first to the last)."""
    monkeypatch.setenv("MOESTREAM_PREFILL_ROWS_IN_LAUNCH_ORDER", "0")
    store = make_store(tiny_model, tmp_path / "store")
    ids = [int(t) for t in np.random.default_rng(5).integers(14, 1000, size=700)]
    ref = prefill(NemotronH(tiny_model), ids, NemotronH(tiny_model).new_state())
    gaps, gather = [], prefill_experts._SortedRows.gather

    def seen(self, segments):
        live = [(a, n) for a, n in segments if n > 0]
        gaps.append(any(a + n != b for (a, n), (b, _) in zip(live, live[1:])))
        return gather(self, segments)
    monkeypatch.setattr(prefill_experts._SortedRows, "gather", seen)
    out, _, _ = _streamed_logits(tiny_model, store, ids, prefill_knobs.PREFILL_BATCH_BYTES, monkeypatch)
    assert any(gaps) and not all(gaps)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

    def gapless(self, segments):
        live = [(a, n) for a, n in segments if n > 0]
        lo, hi = live[0][0], live[-1][0] + live[-1][1]
        local, at = [], 0
        for a, n in segments:
            local.append((at, n))
            at += n
        return self.x[self.tok[lo:hi]], self.ws[lo:hi], self.tok[lo:hi], local
    monkeypatch.setattr(prefill_experts._SortedRows, "gather", gapless)
    bad, _, _ = _streamed_logits(tiny_model, store, ids, prefill_knobs.PREFILL_BATCH_BYTES, monkeypatch)
    assert (bad - ref).abs().max() > 1e-3, "rows gathered across a gap went unnoticed"


@pytest.mark.parametrize("ahead", [False, True])
def test_rows_in_launch_order_need_no_index(tiny_model, tmp_path, monkeypatch, ahead):
    """The default: a layer's pairs sorted by their experts' launch order, so with a cache of a tenth (hits scattered
    among the routed experts; with copies ahead, those copied ahead launched first) every launch reads one run of
    rows (no row index: `launches_indexed` 0) and the logits equal the in-memory engine's. The twin sorted by expert
    id (the knob off) gathers some launches' rows by an index."""
    store = make_store(tiny_model, tmp_path / "store")
    ids = [int(t) for t in np.random.default_rng(5).integers(14, 1000, size=700)]
    ref = prefill(NemotronH(tiny_model), ids, NemotronH(tiny_model).new_state())
    got = {}
    with StreamingEngine(store, model_dir=tiny_model, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead, src.ahead_min_tokens = ahead, 0     # (the CPU path copies ahead only where told to)
        for knob in ("1", "0"):
            monkeypatch.setenv("MOESTREAM_PREFILL_ROWS_IN_LAUNCH_ORDER", knob)
            prefill(eng.model, ids, eng.model.new_state())  # (the second prompt: a guess's copies ahead exist)
            out = prefill(eng.model, ids, eng.model.new_state())
            last = src.prefill_acct.last
            got[knob] = out, last.launches, last.launches_indexed, last.ahead_read
    out, launches, indexed, ahead_read = got["1"]
    assert launches > 0 and indexed == 0 and (ahead_read > 0) == ahead
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    twin, _, indexed_twin, _ = got["0"]
    assert indexed_twin > 0, "the expert-id order's scattered hits needed no index"
    torch.testing.assert_close(twin, ref, rtol=1e-4, atol=1e-4)


def test_a_short_span_takes_the_budgets_slack_for_its_launches():
    """Under the server's 512 MiB a short prompt's launches grow into what its span leaves (a quarter of the budget
    gave 3 Super experts a launch), a long one's keep the plan's quarter, and the span still fits the budget."""
    import torch
    from gpu_worker.prefill import launch_bytes_for, span_bytes, span_plan
    from gpu_worker.prefill_knobs import PREFILL_BATCH_BYTES
    cfg, budget = _super(), 512 << 20
    plan = span_plan(cfg, torch.bfloat16, budget, "cuda")
    short = launch_bytes_for(cfg, torch.bfloat16, budget, 126, plan)
    assert short > 2 * plan.launch() and short <= PREFILL_BATCH_BYTES
    grown = type(plan)(pieces=plan.pieces, launch_bytes=short, fused_attention=plan.fused_attention)
    assert span_bytes(cfg, torch.bfloat16, 126, plan=grown) <= budget
    # the twin: a launch grown past the slack would overrun the budget, so the rule is what keeps it inside
    over = type(plan)(pieces=plan.pieces, launch_bytes=short + (64 << 20), fused_attention=plan.fused_attention)
    assert span_bytes(cfg, torch.bfloat16, 126, plan=over) > budget or short == PREFILL_BATCH_BYTES
    from gpu_worker.prefill import prefill_span
    longest = prefill_span(cfg, torch.bfloat16, budget, device="cuda")
    assert launch_bytes_for(cfg, torch.bfloat16, budget, longest, plan) < plan.launch() + (16 << 20)


def _launches_by_setting(tiny_model, tmp_path, monkeypatch, var: str, values, size: int, seed: int, cached):
    """The in-memory engine's logits for a prompt of `size` tokens, and {value: (logits, launches)} of one streaming
    engine (a cache of `cached(store)` bytes) prefilling it with the environment variable `var` at each value in turn."""
    store = make_store(tiny_model, tmp_path / "store")
    ids = [int(t) for t in np.random.default_rng(seed).integers(14, 1000, size=size)]
    ref = prefill(NemotronH(tiny_model), ids, NemotronH(tiny_model).new_state())
    got = {}
    with StreamingEngine(store, model_dir=tiny_model, cache_bytes=cached(store), io_workers=2) as eng:
        for v in values:
            monkeypatch.setenv(var, v)
            got[v] = prefill(eng.model, ids, eng.model.new_state()), eng.experts.prefill_acct.last.launches
    return ref, got


def test_a_long_span_launches_more_experts_at_once(tiny_model, tmp_path, monkeypatch):
    """A span of MOESTREAM_PREFILL_LONG_SPAN_TOKENS or more launches LONG_SPAN_LAUNCH_EXPERTS experts at once (here 4
    against 2, the tiny model's scale of Super's 64 against 32): fewer launches, the same logits as the in-memory
    engine's. The twin (the long span's length out of reach) launches as many as the short shape, so a long shape
    that changed nothing would be caught."""
    monkeypatch.setattr(prefill_knobs, "PREFILL_LAUNCH_EXPERTS", 2)
    monkeypatch.setattr(prefill_knobs, "LONG_SPAN_LAUNCH_EXPERTS", 4)
    ref, got = _launches_by_setting(tiny_model, tmp_path, monkeypatch, "MOESTREAM_PREFILL_LONG_SPAN_TOKENS",
                                    ("256", "100000"), size=700, seed=9, cached=tenth_of_experts)
    (long_out, long_n), (short_out, short_n) = got["256"], got["100000"]
    torch.testing.assert_close(long_out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(short_out, ref, rtol=1e-4, atol=1e-4)
    # (the cache holds a tenth: the misses launch one by one as they land, whatever the shape)
    assert long_n < short_n, f"a long span's launches {long_n} against the short shape's {short_n}"


def test_a_small_launch_budget_takes_the_fused_path_and_more_experts(tiny_model, tmp_path, monkeypatch):
    """MOESTREAM_PREFILL_FUSED_BELOW: where the dequantized path's scratch caps a launch below that many experts (1 MiB
    launches: 12 of the tiny model's experts with their scratch, 32 without), the layer's launches charge no scratch
    and take more experts: fewer launches, the same logits as the in-memory engine's. The twin (the switch off)
    launches as many as before, so a switch that changed nothing would be caught. (On CUDA those launches run the
    fused kernels; here the torch twin.)"""
    monkeypatch.setenv("MOESTREAM_PREFILL_BATCH_MB", "1")
    # the whole store cached: the launches bounded by their bytes only
    ref, got = _launches_by_setting(tiny_model, tmp_path, monkeypatch, "MOESTREAM_PREFILL_FUSED_BELOW", ("0", "16"),
                                    size=200, seed=5, cached=lambda store: 10 * tenth_of_experts(store))
    (off_out, off_n), (on_out, on_n) = got["0"], got["16"]
    torch.testing.assert_close(on_out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(off_out, ref, rtol=1e-4, atol=1e-4)
    assert on_n < off_n, f"launches without the scratch {on_n} against {off_n} with it"
