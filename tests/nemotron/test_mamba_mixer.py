"""The Mamba2 mixer's prefill paths inside the model: the batched scan against the loop it replaced, and the conv
kernel (kernels/mamba_conv.py, forced on the CPU through Triton's interpreter) against its twin, on a prompt that
spans two pieces and ends in a ragged chunk; a broken scan wired in is caught at the logits."""
from __future__ import annotations

import pytest
import torch

from kernels import backend, mamba_scan
from nemotron import mamba
from nemotron.model import PIECE_TOKENS, NemotronH

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model(synth):
    m = NemotronH(synth("tiny", "bf16", 3), device=DEVICE, dtype=torch.float32)
    assert m.config.chunk_size == 8
    return m


def prefill(model, n=PIECE_TOKENS + 37):
    ids = [(7 * i) % 1000 + 14 for i in range(n)]      # > one piece; 549 = 68 chunks of 8 and 5 tokens
    st = model.new_state()
    logits = model.forward(ids, st, last_only=False)
    states = [(s.ssm.clone(), s.conv.clone()) for s in st.layers if isinstance(s, mamba.MambaState)]
    assert states
    return logits, states


def assert_same(a, b, tol=2e-4):
    (la, sa), (lb, sb) = a, b
    assert la.abs().max() > 0.1
    torch.testing.assert_close(la, lb, atol=tol, rtol=tol)
    for (ssm_a, conv_a), (ssm_b, conv_b) in zip(sa, sb):
        torch.testing.assert_close(ssm_a, ssm_b, atol=tol, rtol=tol)
        torch.testing.assert_close(conv_a, conv_b, atol=tol, rtol=tol)


def test_batched_scan_equals_the_loop_in_the_model(model, monkeypatch):
    new = prefill(model)
    monkeypatch.setattr(mamba, "chunk_scan", mamba_scan.chunk_scan_loop)
    assert_same(new, prefill(model))


@pytest.mark.skipif(DEVICE == "cpu" and not backend.interpreted(), reason="needs Triton's interpreter on the CPU")
def test_conv_kernel_equals_its_twin_in_the_model(model, monkeypatch):
    monkeypatch.setattr(backend, "FORCED", {"mamba_conv": "twin"})
    twin = prefill(model)
    monkeypatch.setattr(backend, "FORCED", {"mamba_conv": "triton"})
    assert_same(twin, prefill(model))


def test_broken_scan_is_caught_at_the_logits(model, monkeypatch):
    """Must-fail twin: the state carried between chunks without their decay changes the logits visibly."""
    good = prefill(model)
    real = mamba_scan._carry
    monkeypatch.setattr(mamba_scan, "_carry", lambda states, S0, decay, S_in: real(states, S0, torch.ones_like(decay), S_in))
    bad = prefill(model)
    assert (good[0] - bad[0]).abs().max() > 1e-2
