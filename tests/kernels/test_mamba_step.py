"""Mamba2 decode step (state update + conv step) against its twins."""
import pytest
import torch

from kernels.mamba_step import conv1d_step, conv1d_step_torch, selective_state_update, selective_state_update_torch
from kernels.testing import assert_close


@pytest.mark.parametrize("nh,hd,N,ng", [(6, 24, 40, 2), (4, 16, 16, 4)])
def test_selective_state_update(nh, hd, N, ng, device):
    state = torch.randn(nh, hd, N, device=device)
    x = torch.randn(nh, hd, device=device).bfloat16()
    dt_raw = torch.randn(nh, device=device).bfloat16()
    dt_bias = torch.randn(nh, device=device) - torch.tensor([9.0] + [0.0] * (nh - 1), device=device)  # one tiny dt
    A = -torch.rand(nh, device=device) * 4
    B, C = torch.randn(ng, N, device=device), torch.randn(ng, N, device=device)
    D = torch.randn(nh, device=device)
    s_ref = state.clone()
    y_ref = selective_state_update_torch(s_ref, x, dt_raw, dt_bias, A, B, C, D)
    y = selective_state_update(state, x, dt_raw, dt_bias, A, B, C, D)
    assert_close(y, y_ref, 1e-5, "y")
    assert_close(state, s_ref, 1e-5, "state")


def test_conv1d_step(device):
    C, K = 200, 4
    st = torch.randn(K - 1, C, device=device).bfloat16()
    x = torch.randn(C, device=device).bfloat16()
    w, b = torch.randn(C, K, device=device), torch.randn(C, device=device)
    st_ref = st.clone()
    ref = conv1d_step_torch(st_ref, x, w, b)
    out = conv1d_step(st, x, w, b)
    assert_close(out.float(), ref.float(), 1e-2, "conv out")     # bf16 output: one rounding
    assert torch.equal(st, st_ref)
