"""The Mamba2 mixer's prefill paths inside the model: the batched scan against the loop it replaced, and the conv
kernel (kernels/mamba_conv.py, forced on the CPU through Triton's interpreter) against its twin, on a prompt that
spans two pieces and ends in a ragged chunk; a broken scan wired in is caught at the logits."""
from __future__ import annotations

import pytest
import torch

from kernels import backend, mamba_scan
from kernels.testing import rel_err
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


@pytest.fixture(scope="module")
def model_bf16(synth):
    return NemotronH(synth("tiny", "bf16", 3), device=DEVICE, dtype=torch.bfloat16)


def prefill_taps(model, n=45, at=(13, 32)):
    """Logits of an n-token prompt (5 chunks of 8 and a ragged 5), the Mamba layers' end states and their states
    captured at `at` inside the one pass."""
    ids = [(7 * i) % 1000 + 14 for i in range(n)]
    st = model.new_state()
    captured = []
    real = mamba.Mamba2Mixer.__call__

    def call(self, h, s, taps=None):
        taps = dict.fromkeys(at)
        out = real(self, h, s, taps)
        captured.append([taps[t].ssm for t in at])
        return out
    mamba.Mamba2Mixer.__call__ = call
    try:
        logits = model.forward(ids, st, last_only=False).float()
    finally:
        mamba.Mamba2Mixer.__call__ = real
    return logits, [s.ssm.clone() for s in st.layers if isinstance(s, mamba.MambaState)], captured


@pytest.mark.skipif(DEVICE == "cpu" and not backend.interpreted(), reason="needs Triton's interpreter on the CPU")
def test_ssd_kernels_equal_the_twin_in_the_model(model_bf16, monkeypatch):
    """kernels/mamba_ssd.py forced (bf16 activations, as on the GPU) against the batched scan it replaces: the same
    logits within bf16's rounding of the mixer's output, the end states and the captured states within the split's
    ~1e-5. Must-fail twin: the kernels' carry without the chunks' decay moves the logits far more."""
    from kernels import mamba_ssd
    monkeypatch.setattr(backend, "FORCED", {"mamba_ssd": "twin"})
    l_twin, s_twin, c_twin = prefill_taps(model_bf16)
    monkeypatch.setattr(backend, "FORCED", {"mamba_ssd": "triton"})
    calls = []
    real = mamba_ssd.ssd_scan
    monkeypatch.setattr(mamba_ssd, "ssd_scan", lambda *a, **k: calls.append(1) or real(*a, **k))
    l_kern, s_kern, c_kern = prefill_taps(model_bf16)
    assert len(calls) == len(s_twin), "every Mamba layer ran the kernels"
    diff = (l_kern - l_twin).abs().max()
    assert l_twin.abs().max() > 1 and diff < 0.05 * l_twin.abs().max()     # (measured 0.19 of 22.5: bf16's step)
    # the first Mamba layer reads the same input both ways: its states agree to the split's precision; later
    # layers read inputs that already differ by bf16 roundings (measured 4e-3 to 9e-3)
    assert rel_err(s_kern[0], s_twin[0]) < 3e-5
    assert all(rel_err(t, u) < 3e-5 for t, u in zip(c_kern[0], c_twin[0]))
    assert all(rel_err(t, u) < 3e-2 for t, u in zip(s_kern, s_twin))
    assert all(rel_err(t, u) < 3e-2 for a, b in zip(c_kern, c_twin) for t, u in zip(a, b))
    monkeypatch.setattr(mamba_ssd, "_carry",
                        lambda states, S0, decay, S_in: mamba_scan._carry(states, S0, torch.ones_like(decay), S_in))
    l_bad, _, _ = prefill_taps(model_bf16)
    assert (l_bad - l_twin).abs().max() > 4 * diff
