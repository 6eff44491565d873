"""The engine's logits and greedy decode against transformers' NemotronH (fp32, CPU, dequantized checkpoint)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nemotron.model import NemotronH
from tests.conftest import copy_with_swapped_nibbles
from tools.hf_reference import dequantize_checkpoint, hf_logits_and_greedy, load_hf_model
from tools.logits import logits_and_greedy

KL_MAX = 1e-3
N_GREEDY = 32
TIE = 1e-4   # reference top-2 logits closer than this are a true tie in fp32


def mean_kl(ref: np.ndarray, got: np.ndarray) -> float:
    lr = torch.log_softmax(torch.from_numpy(ref).double(), -1)
    lg = torch.log_softmax(torch.from_numpy(got).double(), -1)
    return float((lr.exp() * (lr - lg)).sum(-1).mean())


def greedy_agreement(ref_tokens, ref_logits_prev, got_tokens) -> tuple[int, bool]:
    """Tokens equal up to the first difference; the difference is excused only if the reference had a tie."""
    for i, (a, b) in enumerate(zip(ref_tokens, got_tokens)):
        if a != b:
            lg = ref_logits_prev[i]
            return i, bool(abs(lg[a] - lg[b]) < TIE)
    return len(ref_tokens), True


def prompt(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(14, cfg.vocab_size, size=n)]


def reference(model_dir, ids, n, tmp_path):
    hf = load_hf_model(dequantize_checkpoint(model_dir, tmp_path / "dense"))
    logits, greedy, gl = hf_logits_and_greedy(hf, ids, n)
    return logits, greedy, gl      # gl row i: the logits that chose greedy token i


def compare(model_dir, tmp_path, n_prompt=None, seed=0, engine_dir=None):
    engine = NemotronH(engine_dir or model_dir)
    cfg = engine.config
    ids = prompt(cfg, n_prompt or 3 * cfg.chunk_size + 5, seed)
    assert len(ids) > cfg.chunk_size
    ref_logits, ref_greedy, ref_prev = reference(model_dir, ids, N_GREEDY, tmp_path)
    logits, greedy, _ = logits_and_greedy(engine, ids, N_GREEDY)
    kl = mean_kl(ref_logits, logits)
    agree, excused = greedy_agreement(ref_greedy, ref_prev, greedy)
    return kl, agree, excused, ref_logits


@pytest.mark.parametrize("quant", ["nvfp4", "mixed", "bf16"])
def test_engine_matches_transformers(synth, tmp_path, quant):
    model_dir = synth("tiny", quant)
    kl, agree, excused, ref_logits = compare(model_dir, tmp_path)
    top1 = torch.softmax(torch.from_numpy(ref_logits), -1).max(-1).values.mean().item()
    print(f"{quant}: mean KL {kl:.2e}, greedy {agree}/{N_GREEDY}, reference mean top-1 prob {top1:.2f}")
    assert kl < KL_MAX
    assert agree == N_GREEDY or excused, f"greedy differs at token {agree} without a tie in the reference"
    assert top1 > 0.2, "synthetic logits are too flat for this check to have power"


def test_nibble_swapped_checkpoint_fails(synth, tmp_path):
    """The must-fail twin: the same checks must fail, by a wide margin, when the nibble order is wrong."""
    model_dir = synth("tiny", "nvfp4")
    swapped = copy_with_swapped_nibbles(model_dir, tmp_path / "swapped")
    kl, agree, excused, _ = compare(model_dir, tmp_path, engine_dir=swapped)
    print(f"nibble-swapped: mean KL {kl:.3f}, greedy {agree}/{N_GREEDY}")
    assert kl > 100 * KL_MAX
    assert agree < N_GREEDY


def test_prefill_then_decode_equals_one_prefill(synth):
    engine = NemotronH(synth("tiny", "nvfp4"))
    ids = prompt(engine.config, 2 * engine.config.chunk_size + 3, seed=5)
    full = engine.forward(ids, engine.new_state())
    st = engine.new_state()
    cut = engine.config.chunk_size + 1
    parts = [engine.forward(ids[:cut], st)]
    parts += [engine.forward([t], st) for t in ids[cut:cut + 4]]
    parts.append(engine.forward(ids[cut + 4:], st))
    assert st.position == len(ids)
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-4, atol=1e-4)
    # and a cloned state continues identically
    st2 = engine.new_state()
    engine.forward(ids[:cut], st2)
    snap = st2.clone()
    a = engine.forward(ids[cut:], st2)
    b = engine.forward(ids[cut:], snap)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
