"""An experiment, not in the engine until measured: kernels/mamba_scan.py's batched scan with its intra-chunk output
fused into one Triton launch.

Of the batched scan's ~24 launches a 512-token piece, 10 and its largest tensor (the [c, heads, Q, Q] decay
matrices, 32 MiB on Super) exist only to form
  y_i = Σ_{j<=i} (C_i·B_j) exp(s_i − s_j) dt_j x_j + exp(s_i) C_i · S_in
per (chunk, head). One program here computes a block of rows i of one (chunk, head): C_i·B_j a block of j at a
time, the decay, the weighted sum of x, and the start state's part, in registers (fp32, IEEE products). The chunk
states and the recurrence between chunks stay as they are (two GEMMs and c small launches). The twin is
kernels.mamba_scan.chunk_scan; bench/mamba_prefill.py times the three (loop, batched, fused) on the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import varying
from kernels.mamba_scan import _carry, _check


@triton.jit(**varying("x_ptr", "B_ptr", "C_ptr"))
def _chunk_out_kernel(
    x_ptr, dt_ptr, acs_ptr, B_ptr, C_ptr, S_ptr, y_ptr,
    Q, nh, hd, N, heads_per_group, sx_t, sb_t, sc_t,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_i, h, ci = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // heads_per_group
    o_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    m_i, m_d, m_n = o_i < Q, o_d < hd, o_n < N
    t_i = ci * Q + o_i
    b_C = tl.load(C_ptr + t_i[:, None] * sc_t + g * N + o_n[None, :], mask=m_i[:, None] & m_n[None, :],
                  other=0.0).to(tl.float32)
    b_si = tl.load(acs_ptr + t_i * nh + h, mask=m_i, other=0.0)
    # what the chunk's start state gives each row: exp(s_i) C_i · S_in[ci, h]
    b_S = tl.load(S_ptr + ((ci * nh + h) * hd + o_d[:, None]) * N + o_n[None, :], mask=m_d[:, None] & m_n[None, :],
                  other=0.0)
    b_acc = tl.dot(b_C, tl.trans(b_S), input_precision="ieee") * tl.exp(b_si)[:, None]
    # the chunk's own tokens j <= i, a block at a time up to the end of this block of rows
    for j0 in range(0, (pid_i + 1) * BLOCK_I, BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)
        m_j = o_j < Q
        t_j = ci * Q + o_j
        b_B = tl.load(B_ptr + t_j[:, None] * sb_t + g * N + o_n[None, :], mask=m_j[:, None] & m_n[None, :],
                      other=0.0).to(tl.float32)
        b_sj = tl.load(acs_ptr + t_j * nh + h, mask=m_j, other=0.0)
        b_dt = tl.load(dt_ptr + t_j * nh + h, mask=m_j, other=0.0)
        b_x = tl.load(x_ptr + t_j[:, None] * sx_t + h * hd + o_d[None, :], mask=m_j[:, None] & m_d[None, :],
                      other=0.0).to(tl.float32)
        b_cb = tl.dot(b_C, tl.trans(b_B), input_precision="ieee")                 # [BLOCK_I, BLOCK_J]
        causal = (o_i[:, None] >= o_j[None, :]) & m_i[:, None] & m_j[None, :]
        # above the diagonal (and in padding rows) s_i - s_j >= 0 and exp could overflow: -inf first, exp gives 0
        b_w = b_cb * tl.exp(tl.where(causal, b_si[:, None] - b_sj[None, :], -float("inf"))) * b_dt[None, :]
        b_acc += tl.dot(b_w, b_x, input_precision="ieee")
    tl.store(y_ptr + t_i[:, None] * (nh * hd) + h * hd + o_d[None, :], b_acc, mask=m_i[:, None] & m_d[None, :])


def chunk_scan_fused(x, dt, A, B, C, state, chunk_size: int):
    """Same arguments and results as kernels.mamba_scan.chunk_scan (x, B, C with contiguous last two dims)."""
    _check(x, dt, A, B, C, state, chunk_size)
    T = x.shape[0]
    Q = min(chunk_size, T)
    whole = T - T % Q
    y = torch.empty(x.shape, device=x.device)
    S = _whole_chunks_fused(x[:whole], dt[:whole], A, B[:whole], C[:whole], state, Q, y[:whole])
    if whole < T:
        S = _whole_chunks_fused(x[whole:], dt[whole:], A, B[whole:], C[whole:], S, T - whole, y[whole:])
    return y, S


def _whole_chunks_fused(x, dt, A, B, C, S0, Q: int, y):
    T, nh, hd = x.shape
    ng, N = B.shape[1:]
    c, r = T // Q, nh // ng
    for name, t in (("x", x), ("B", B), ("C", C)):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"{name}: its last two dims must be contiguous (rows may be strided)")
    dt = dt.contiguous()
    acs = torch.cumsum((dt * A).view(c, Q, nh), dim=1)               # [c, Q, nh]
    acs_h = acs.transpose(1, 2)
    Bg = torch.empty(c * ng, Q, N, device=x.device)
    Bg.view(c, ng, Q, N).copy_(B.reshape(c, Q, ng, N).transpose(1, 2))
    to_end = torch.exp(acs_h[..., -1:] - acs_h)                      # [c, nh, Q]
    xs = torch.empty(c, nh, hd, Q, device=x.device)                  # dt_j exp(s_Q - s_j) x_j, laid out for the GEMM
    torch.mul(x.reshape(c, Q, nh, hd).permute(0, 2, 3, 1), (dt.view(c, Q, nh).transpose(1, 2) * to_end)[:, :, None, :],
              out=xs)
    states = torch.bmm(xs.view(c * ng, r * hd, Q), Bg).view(c, nh, hd, N)
    del xs, Bg
    S_in = torch.empty(c, nh, hd, N, device=x.device)
    S = _carry(states, S0, torch.exp(acs[:, -1, :]), S_in)
    del states
    block_i = 64 if Q >= 64 else 16
    block_d, block_n = max(16, triton.next_power_of_2(hd)), max(16, triton.next_power_of_2(N))
    _chunk_out_kernel[(triton.cdiv(Q, block_i), nh, c)](
        x, dt, acs, B, C, S_in, y, Q, nh, hd, N, r, x.stride(0), B.stride(0), C.stride(0),
        BLOCK_I=block_i, BLOCK_J=16 if block_i == 16 else 32, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4)
    return S
