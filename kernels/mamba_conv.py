"""Mamba2 prefill: the causal depthwise conv1d over a piece of tokens, with SiLU, in one launch.

  out[t, c] = silu(b[c] + Σ_k seq[t + k, c] · w[c, k]),   seq = [the last K-1 inputs (the conv state); x]
in fp32, stored in x's dtype; the new state is seq's last K-1 rows. The plain-PyTorch twin goes tap by tap over
fp32 copies of the whole piece (~13 launches and four [T, conv_dim] fp32 passes); the kernel reads each input row
K times from cache and writes the output once. kernels/mamba_step.py holds the one-token step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.backend import varying


@triton.jit(**varying("T", "x_ptr"))      # a prompt's last piece has any length: compile once, not per length class
def _conv_prefill_kernel(
    state_ptr, x_ptr, w_ptr, b_ptr, out_ptr,
    T, C, stride_x,
    KM1: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_t = o_t < T
    m_c = o_c < C
    b_acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + tl.load(b_ptr + o_c, mask=m_c, other=0.0)[None, :]
    for k in tl.static_range(KM1 + 1):
        # tap k of output t reads seq[t + k]: input row t + k - (K-1), or, before the first input, a state row
        o_src = o_t + k - KM1
        m_x = (m_t & (o_src >= 0))[:, None] & m_c[None, :]
        m_s = (m_t & (o_src < 0))[:, None] & m_c[None, :]
        b_x = tl.load(x_ptr + o_src[:, None] * stride_x + o_c[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_s = tl.load(state_ptr + (o_src + KM1)[:, None] * C + o_c[None, :], mask=m_s, other=0.0).to(tl.float32)
        b_w = tl.load(w_ptr + o_c * (KM1 + 1) + k, mask=m_c, other=0.0)
        b_acc += (b_x + b_s) * b_w[None, :]          # one of the two loads is masked to 0: the sum is exact
    b_out = b_acc * tl.sigmoid(b_acc)
    tl.store(out_ptr + o_t[:, None] * C + o_c[None, :], b_out.to(out_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])


def _check(state, x, w, b):
    if x.dim() != 2 or state.dim() != 2 or state.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [tokens, channels] and the state [K-1, channels], got {tuple(x.shape)} and "
                         f"{tuple(state.shape)}")
    C = x.shape[1]
    if state.shape[0] < 1:
        raise ValueError("a conv of kernel size 1 keeps no state: K must be at least 2")
    if w.shape != (C, state.shape[0] + 1) or b.shape != (C,):
        raise ValueError(f"w must be [{C}, K={state.shape[0] + 1}] and b [{C}], got {tuple(w.shape)} and "
                         f"{tuple(b.shape)}")
    if w.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"w and b must be fp32, got {w.dtype} and {b.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x's channels must be contiguous (rows may be strided)")


def _new_state(state, x):
    """seq's last K-1 rows, in x's dtype, in a buffer of their own (never a view of the piece's activations)."""
    km1, T = state.shape[0], x.shape[0]
    if T >= km1:
        return torch.empty(km1, x.shape[1], dtype=x.dtype, device=x.device).copy_(x[T - km1:])
    return torch.cat([state.to(x.dtype), x])[-km1:].clone()


def causal_conv1d(state, x, w, b):
    """state [K-1, C] (the last K-1 inputs; not modified), x [T, C] (rows may be strided), w fp32 [C, K], b fp32 [C]
    -> (silu(conv) [T, C] in x's dtype, the new state [K-1, C])."""
    _check(state, x, w, b)
    T, C = x.shape
    km1 = state.shape[0]
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    block_t, block_c = 32, 128
    _conv_prefill_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
        state.contiguous(), x, w.contiguous(), b, out, T, C, x.stride(0),
        KM1=km1, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    return out, _new_state(state, x)


def causal_conv1d_torch(state, x, w, b):
    """The twin, tap by tap over fp32 copies (no [T, C, K] windows). Same arguments and results."""
    _check(state, x, w, b)
    seq = torch.cat([state.to(x.dtype), x], dim=0)                  # [K-1+T, C]
    seqf = seq.float()
    T, K = x.shape[0], w.shape[1]
    out = b + seqf[:T] * w[:, 0]
    for k in range(1, K):
        out = out + seqf[k:k + T] * w[:, k]
    return F.silu(out).to(x.dtype), seq[-(K - 1):].clone()
