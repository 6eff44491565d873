"""kernels/mamba_carry.py: the scan's recurrence between chunks in one launch against its twin (one addcmul a chunk)
and a float64 step-by-step reference, on fresh random inputs of odd shapes; a carry that drops the decay, or reads
the neighbouring head's decay, is caught."""
from __future__ import annotations

import pytest
import torch

from kernels import backend, mamba_carry, mamba_scan
from kernels.mamba_carry import carry, carry_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not backend.interpreted(),
                                reason="needs a GPU or Triton's interpreter")


def inputs(c, nh, hd, N, device):
    states = torch.randn(c, nh, hd, N, device=device)
    S0 = torch.randn(nh, hd, N, device=device)
    decay = torch.rand(c, nh, device=device) * 0.98 + 0.01
    return states, S0, decay


def reference64(states, S0, decay):
    S, starts = S0.double(), []
    for k in range(states.shape[0]):
        starts.append(S)
        S = S * decay[k].double()[:, None, None] + states[k].double()
    return torch.stack(starts), S


@pytest.mark.parametrize("c,nh,hd,N", [(1, 3, 5, 7), (3, 2, 4, 9), (7, 5, 3, 11), (32, 4, 16, 17)])
def test_kernel_equals_twin_and_reference(device, c, nh, hd, N):
    states, S0, decay = inputs(c, nh, hd, N, device)
    S_in_k, S_in_t = torch.full_like(states, float("nan")), torch.full_like(states, float("nan"))
    out_k = carry(states, S0, decay, S_in_k)
    out_t = carry_torch(states, S0, decay, S_in_t)
    starts, last = reference64(states, S0, decay)
    torch.testing.assert_close(out_k, out_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S_in_k, S_in_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k.double(), last, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S_in_k.double(), starts, rtol=1e-5, atol=1e-5)


def test_broken_carries_are_caught(device):
    """Must-fail twins: the decay left out, and each element decayed by the next head's decay."""
    states, S0, decay = inputs(5, 3, 4, 6, device)
    good = carry(states, S0, decay, torch.empty_like(states))
    no_decay = carry_torch(states, S0, torch.ones_like(decay), torch.empty_like(states))
    shifted = carry_torch(states, S0, decay.roll(1, dims=1), torch.empty_like(states))
    for bad in (no_decay, shifted):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(good, bad, rtol=1e-5, atol=1e-5)


def test_scan_takes_the_kernel_and_matches_the_loop(device, monkeypatch):
    """chunk_scan with the carry kernel forced equals the reference loop over chunks (several chunks, a ragged
    tail); the kernel really ran (a spy counts its calls)."""
    T, nh, hd, ng, N, Q = 45, 4, 3, 2, 5, 8
    x = torch.randn(T, nh, hd, device=device)
    dt = torch.rand(T, nh, device=device) * 0.5 + 0.01
    A = -(torch.rand(nh, device=device) * 3 + 0.1)
    B, C = torch.randn(T, ng, N, device=device), torch.randn(T, ng, N, device=device)
    S0 = torch.randn(nh, hd, N, device=device)
    calls = []
    real = mamba_carry.carry
    monkeypatch.setattr(mamba_carry, "carry", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(backend, "FORCED", {"mamba_carry": "triton"})
    y, S = mamba_scan.chunk_scan(x, dt, A, B, C, S0, Q)
    y_ref, S_ref = mamba_scan.chunk_scan_loop(x, dt, A, B, C, S0, Q)
    assert len(calls) == 2          # the whole chunks, then the ragged one
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S, S_ref, rtol=1e-4, atol=1e-4)


def test_bad_input_is_named(device):
    states, S0, decay = inputs(3, 2, 4, 5, device)
    with pytest.raises(ValueError, match="decay must be"):
        carry(states, S0, decay[:, :1], torch.empty_like(states))
    with pytest.raises(ValueError, match="fp32"):
        carry(states.double(), S0.double(), decay.double(), torch.empty_like(states).double())
    with pytest.raises(ValueError, match="S0"):
        carry(states, S0[:1], decay, torch.empty_like(states))


def test_on_by_default_on_cuda(device, monkeypatch):
    """Measured on the H200 (session 8): the scan takes the kernel on CUDA unless MOESTREAM_MAMBA_CARRY_KERNEL=0; the
    twin on the CPU unless FORCED."""
    states = torch.zeros(2, 1, 1, 1, device=device)
    monkeypatch.setattr(backend, "FORCED", {})
    monkeypatch.delenv("MOESTREAM_MAMBA_CARRY_KERNEL", raising=False)
    assert mamba_carry.use_kernel(states) == (device == "cuda")
    monkeypatch.setenv("MOESTREAM_MAMBA_CARRY_KERNEL", "0")
    assert not mamba_carry.use_kernel(states)
    monkeypatch.setenv("MOESTREAM_MAMBA_CARRY_KERNEL", "1")
    assert mamba_carry.use_kernel(states) == (device == "cuda")
    monkeypatch.setattr(backend, "FORCED", {"mamba_carry": "twin"})
    assert not mamba_carry.use_kernel(states)
