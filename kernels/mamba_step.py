"""Mamba2 decode step: selective state update and the causal conv1d step, each one launch, state in place.

The state update reads and writes the fp32 SSM state [heads, head_dim, N] once (4 MiB per Super layer);
plain torch makes several passes over it. Semantics are nemotron/mamba.py's (no dt floor, D skip on x):
  dt = softplus(dt_raw + dt_bias); state = state · exp(dt A) + dt · x ⊗ B_g; y = state · C_g + D x
with head h in group g = h // (heads / groups). The conv step keeps the last K-1 inputs, [K-1, conv_dim].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _softplus(v):
    e = tl.exp(v)
    # log(1 + e) loses e's digits when e is tiny (dt_bias near -9 is real); use the series there
    small = e * (1.0 - e * (0.5 - e / 3.0))
    return tl.where(v > 20.0, v, tl.where(e < 1e-3, small, tl.log(1.0 + e)))


@triton.jit
def _ssu_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr,
    hd, N, heads_per_group,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    h = tl.program_id(0)
    pid_p = tl.program_id(1)
    g = h // heads_per_group
    o_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_p = o_p < hd
    m_n = o_n < N
    dt = _softplus(tl.load(dt_ptr + h).to(tl.float32) + tl.load(dt_bias_ptr + h))
    dA = tl.exp(dt * tl.load(A_ptr + h))
    b_x = tl.load(x_ptr + h * hd + o_p, mask=m_p, other=0.0).to(tl.float32)
    b_B = tl.load(B_ptr + g * N + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_C = tl.load(C_ptr + g * N + o_n, mask=m_n, other=0.0).to(tl.float32)
    p_s = state_ptr + (h * hd + o_p[:, None]) * N + o_n[None, :]
    m_s = m_p[:, None] & m_n[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)
    b_s = b_s * dA + (dt * b_x)[:, None] * b_B[None, :]
    tl.store(p_s, b_s, mask=m_s)
    b_y = tl.sum(b_s * b_C[None, :], axis=1) + tl.load(D_ptr + h) * b_x
    tl.store(y_ptr + h * hd + o_p, b_y, mask=m_p)


def selective_state_update(state, x, dt_raw, dt_bias, A, B, C, D):
    """state fp32 [nh, hd, N] (updated in place); x [nh, hd]; dt_raw [nh]; dt_bias, A, D fp32 [nh];
    B, C [ng, N]. Returns y fp32 [nh, hd] (D skip included, gate and norm not)."""
    nh, hd, N = state.shape
    ng = B.shape[0]
    assert state.dtype == torch.float32 and state.is_contiguous() and x.is_contiguous()
    y = torch.empty((nh, hd), dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(N)
    block_p = max(1, min(triton.next_power_of_2(hd), 4096 // block_n))
    _ssu_kernel[(nh, triton.cdiv(hd, block_p))](state, x, dt_raw, dt_bias, A, B.contiguous(), C.contiguous(), D, y,
                                                hd, N, nh // ng, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return y


def selective_state_update_torch(state, x, dt_raw, dt_bias, A, B, C, D):
    nh, hd, N = state.shape
    rep = nh // B.shape[0]
    dt = F.softplus(dt_raw.float() + dt_bias)
    Bh, Ch = B.float().repeat_interleave(rep, 0), C.float().repeat_interleave(rep, 0)
    state.copy_(state * torch.exp(dt * A)[:, None, None] + (dt[:, None] * x.float())[:, :, None] * Bh[:, None, :])
    return torch.einsum("hdn,hn->hd", state, Ch) + D[:, None] * x.float()


@triton.jit
def _conv_step_kernel(state_ptr, x_ptr, w_ptr, b_ptr, out_ptr, C, KM1: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < C
    b_x = tl.load(x_ptr + o, mask=m, other=0.0)
    acc = tl.load(b_ptr + o, mask=m, other=0.0) + b_x.to(tl.float32) * tl.load(w_ptr + o * (KM1 + 1) + KM1, mask=m)
    for i in tl.static_range(KM1):
        b_s = tl.load(state_ptr + i * C + o, mask=m, other=0.0)
        acc += b_s.to(tl.float32) * tl.load(w_ptr + o * (KM1 + 1) + i, mask=m, other=0.0)
        if i > 0:
            tl.store(state_ptr + (i - 1) * C + o, b_s, mask=m)   # shift the window down by one
    tl.store(state_ptr + (KM1 - 1) * C + o, b_x, mask=m)
    tl.store(out_ptr + o, acc * tl.sigmoid(acc), mask=m)


def conv1d_step(conv_state, x, w, b):
    """conv_state [K-1, C] (updated in place: the last K-1 inputs), x [C], w fp32 [C, K], b fp32 [C].
    Returns silu(conv) [C] in x's dtype."""
    km1, C = conv_state.shape
    assert w.shape == (C, km1 + 1) and conv_state.is_contiguous() and w.is_contiguous()
    out = torch.empty_like(x)
    block = 1024
    _conv_step_kernel[(triton.cdiv(C, block),)](conv_state, x, w, b, out, C, KM1=km1, BLOCK=block, num_warps=4)
    return out


def conv1d_step_torch(conv_state, x, w, b):
    seq = torch.cat([conv_state.to(x.dtype), x[None]], dim=0)        # [K, C]
    out = (seq.float().t() * w).sum(-1) + b
    conv_state.copy_(seq[1:])
    return F.silu(out).to(x.dtype)
