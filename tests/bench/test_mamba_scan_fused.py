"""The fused-output scan experiment (bench/kernels/mamba_scan_fused.py, Triton interpreted on the CPU) against the
loop twin on odd shapes, bf16 strided inputs as the mixer passes them; a must-fail twin: the state carried without
its chunk decay, which only the kernel's start-state term sees."""
import pytest
import torch

from bench.kernels import mamba_scan_fused
from bench.kernels.mamba_scan_fused import chunk_scan_fused
from kernels.mamba_scan import _carry, chunk_scan_loop
from kernels.testing import assert_close, rel_err
from tests.kernels.test_mamba_scan import CASES, inputs

TOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # on the CPU, Triton's interpreter (tests/conftest.py)


def strided(T, nh, hd, N, ng, device):
    """x, B, C as bf16 views into one [T, nh·hd + 2·ng·N] conv output, as the mixer hands them over."""
    x, dt, A, _, _, S0 = inputs(T, nh, hd, N, ng, device)
    xBC = torch.randn(T, nh * hd + 2 * ng * N, device=device).bfloat16()
    xv, B, C = xBC.split([nh * hd, ng * N, ng * N], dim=-1)
    return xv.view(T, nh, hd), dt, A, B.view(T, ng, N), C.view(T, ng, N), S0


@pytest.mark.parametrize("T,Q,nh,hd,N,ng", CASES + [(150, 64, 4, 8, 16, 2)])
def test_fused_equals_loop(T, Q, nh, hd, N, ng):
    x, dt, A, B, C, S0 = strided(T, nh, hd, N, ng, DEVICE)
    y, S = chunk_scan_fused(x, dt, A, B, C, S0, Q)
    y_ref, S_ref = chunk_scan_loop(x, dt, A, B, C, S0, Q)
    assert_close(y, y_ref, TOL, "y")
    assert_close(S, S_ref, TOL, "state")


def test_strong_decay_stays_finite():
    x, dt, A, B, C, S0 = inputs(40, 4, 3, 5, 2, DEVICE, strong_decay=True)
    y, S = chunk_scan_fused(x, dt, A, B, C, S0, 32)
    y_ref, _ = chunk_scan_loop(x, dt, A, B, C, S0, 32)
    assert torch.isfinite(y).all()
    assert_close(y, y_ref, TOL, "y")


def test_carry_without_decay_is_caught(monkeypatch):
    monkeypatch.setattr(mamba_scan_fused, "_carry",
                        lambda states, S0, decay, S_in: _carry(states, S0, torch.ones_like(decay), S_in))
    x, dt, A, B, C, S0 = strided(37, 6, 5, 7, 3, DEVICE)
    y, _ = chunk_scan_fused(x, dt, A, B, C, S0, 8)
    y_ref, _ = chunk_scan_loop(x, dt, A, B, C, S0, 8)
    assert rel_err(y, y_ref) > 100 * TOL


def test_inner_dims_must_be_contiguous():
    x, dt, A, B, C, S0 = inputs(10, 4, 3, 5, 2, DEVICE)
    with pytest.raises(ValueError, match="x: its last two dims"):
        chunk_scan_fused(x.transpose(1, 2).contiguous().transpose(1, 2), dt, A, B, C, S0, 4)
