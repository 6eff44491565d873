"""Mamba2 prefill: the chunked SSD scan on the tensor cores, three launches a piece (kernels/mamba_scan.py's
`chunk_scan` plus the mixer's D·x is the plain-PyTorch twin, `ssd_scan_torch`).

Per head h of group g, token t (dt after softplus; A < 0):
  state_h <- state_h · exp(dt_h A_h) + dt_h x_h ⊗ B_g ;   y_h = state_h · C_g + D_h x_h
Chunked (Q tokens a chunk, s_i = Σ_{t≤i} dt_t A inside the chunk):
  y_i = Σ_{j≤i} (C_i·B_j) exp(s_i − s_j) dt_j x_j  +  exp(s_i) C_i · S_in  +  D x_i
  S_end = exp(s_Q) S_in + Σ_j x_j ⊗ (exp(s_Q − s_j) dt_j B_j)

Why: the twin runs ~20 launches a 4,096-token piece through fp32 cuBLAS on the CUDA cores and a [chunks, heads, Q, Q]
decay tensor of 256 MiB (exp, tril, a broadcast product, each a pass over it). H200 session 8's 16k profile: ~37 ms of
its ~139 ms of compute are these (fp32 GEMMs 11.6 ms, the decay's mul / sub / exp / tril ~14 ms, the casts, the
combine and D·x ~11 ms) for ~0.4 TFLOP of products. Here:
  1. `_ssd_state_kernel`, one program a (chunk, head): the chunk's cumulative decay (written out for 3), its total
     decay, and its end state from its own tokens, x^T · (w ∘ B) on the tensor cores.
  2. kernels/mamba_carry.py: the recurrence from chunk to chunk (unchanged).
  3. `_ssd_out_kernel`, one program a (block of rows, head, chunk): C·B, the decay, the weighted x, the start
     state's part and D·x, all in registers; y written once, fp32.

Precision: x, B, C arrive in bf16 (the conv's output), so every product of two of them is exact in fp32, as in the
twin. The fp32 operands (the decay-weighted C·B, the weighted B, the start state) are split as hi + lo, two bf16
numbers whose sum is within 2^-17 of the value, and multiplied by two bf16 MMAs with fp32 accumulation: each
product within ~8e-6 of the fp32 one (the mixer casts y to bf16 afterwards, 2^-9). Under Triton's interpreter the
bf16 operands are upcast first (UPCAST: its bf16 tl.dot multiplies raw integers), which is the same arithmetic.
On by default since session 11's H200 run (bench/NOTES.md "Session 11", call 4: the scan 3.6x faster, 10.6 -> 2.9 ms
at 16,000 tokens, within 8e-7 / 2.7e-6 of the twin; TTFT 4,000 tokens 132 / 125 -> 123 / 120 ms, 16,000 195 / 222 ->
184 / 195 ms, first tokens equal); MOESTREAM_MAMBA_SSD=0 keeps the PyTorch scan (`use_kernel`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.backend import varying
from kernels.mamba_scan import _carry, _state_at, chunk_scan
from kernels.mamba_scan import _check as _check_scan

_UPCAST = backend.interpreted()


def use_kernel(x: torch.Tensor) -> bool:
    """The kernels where kernels.backend.FORCED names "mamba_ssd" (the tests), else on CUDA with bf16 activations
    unless MOESTREAM_MAMBA_SSD=0 (read per call, so a bench can A/B it in one process). fp32 activations keep the
    twin: their products would not be exact in bf16."""
    if "mamba_ssd" in backend.FORCED or "*" in backend.FORCED:
        return backend.use_triton(x, "mamba_ssd") and x.dtype == torch.bfloat16
    return x.is_cuda and x.dtype == torch.bfloat16 and os.environ.get("MOESTREAM_MAMBA_SSD", "1") != "0"


@triton.jit
def _exact_dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b for bf16 a and b: each product exact in fp32."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _split(a):
    """fp32 a as hi + lo, two bf16 tiles whose sum is within 2^-17 |a| of it (Triton rounds to nearest on the GPU;
    its interpreter truncates, within 2^-14)."""
    hi = a.to(tl.bfloat16)
    return hi, (a - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _split_dot(a, b, acc, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b for a fp32 [M, K] and b bf16 [K, N]: a split, two MMAs (see the module's note); without SPLIT
    one MMA of a rounded to bf16 (2^-9: mamba_ssm's way; the bench's and the tests' lesser variant)."""
    hi, lo = _split(a)
    acc = _exact_dot(hi, b, acc, UPCAST)
    if SPLIT:
        acc = _exact_dot(lo, b, acc, UPCAST)
    return acc


@triton.jit
def _dot_split(a, b, acc, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b for a bf16 [M, K] and b fp32 [K, N]: b split, two MMAs."""
    hi, lo = _split(b)
    acc = _exact_dot(a, hi, acc, UPCAST)
    if SPLIT:
        acc = _exact_dot(a, lo, acc, UPCAST)
    return acc


@triton.jit(**varying("x_ptr", "dt_ptr", "B_ptr", "T"))
def _ssd_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, acs_ptr, decay_ptr, states_ptr,
    T, Q, nh, hd, N, heads_per_group, sx_t, sb_t,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):
    ci, h, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // heads_per_group
    o_q = tl.arange(0, BLOCK_Q)
    o_d = tl.arange(0, BLOCK_D)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t = ci * Q + o_q
    m_q = (o_q < Q) & (t < T)
    m_d, m_n = o_d < hd, o_n < N
    b_dt = tl.load(dt_ptr + t * nh + h, mask=m_q, other=0.0)
    b_s = tl.cumsum(b_dt * tl.load(A_ptr + h), axis=0)               # padding adds 0: s stays at the last token's
    # with N in several blocks (a grid's third axis), every block computes s; the first writes it
    n_valid = tl.minimum(Q, T - ci * Q)
    s_last = tl.sum(tl.where(o_q == n_valid - 1, b_s, 0.0), axis=0)
    if pid_n == 0:
        tl.store(acs_ptr + t * nh + h, b_s, mask=m_q)
        tl.store(decay_ptr + ci * nh + h, tl.exp(s_last))
    # exp(s_Q - s_j) dt_j on B's rows (<= 1: s falls along the chunk); 0 on padding rows
    b_w = tl.where(m_q, tl.exp(s_last - b_s) * b_dt, 0.0)
    b_B = tl.load(B_ptr + t[:, None].to(tl.int64) * sb_t + g * N + o_n[None, :], mask=m_q[:, None] & m_n[None, :],
                  other=0.0)
    b_xT = tl.load(x_ptr + t[None, :].to(tl.int64) * sx_t + h * hd + o_d[:, None], mask=m_d[:, None] & m_q[None, :],
                   other=0.0)                                            # [hd, Q]
    # x^T (w ∘ B): x exact in bf16, the fp32 weighted B split
    acc = _dot_split(b_xT, b_B.to(tl.float32) * b_w[:, None], tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32), SPLIT,
                     UPCAST)
    p = states_ptr + ((ci * nh + h).to(tl.int64) * hd + o_d[:, None]) * N + o_n[None, :]
    tl.store(p, acc, mask=m_d[:, None] & m_n[None, :])


@triton.jit(**varying("x_ptr", "dt_ptr", "B_ptr", "C_ptr", "T"))
def _ssd_out_kernel(
    x_ptr, dt_ptr, acs_ptr, B_ptr, C_ptr, S_ptr, D_ptr, y_ptr,
    T, Q, nh, hd, N, heads_per_group, sx_t, sb_t, sc_t,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_i, h, ci = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // heads_per_group
    o_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    t_i = ci * Q + o_i
    m_i = (o_i < Q) & (t_i < T)
    m_d, m_n = o_d < hd, o_n < N
    b_C = tl.load(C_ptr + t_i[:, None].to(tl.int64) * sc_t + g * N + o_n[None, :], mask=m_i[:, None] & m_n[None, :],
                  other=0.0)
    b_si = tl.load(acs_ptr + t_i * nh + h, mask=m_i, other=0.0)
    # the start state's part, exp(s_i) C_i · S_in: the state split, C exact
    b_ST = tl.load(S_ptr + ((ci * nh + h).to(tl.int64) * hd + o_d[None, :]) * N + o_n[:, None],
                   mask=m_n[:, None] & m_d[None, :], other=0.0)                  # S_in^T [N, hd]
    acc = _dot_split(b_C, b_ST, tl.zeros((BLOCK_I, BLOCK_D), dtype=tl.float32), SPLIT, UPCAST)
    acc = acc * tl.exp(b_si)[:, None]
    # the chunk's own tokens j <= i, a block of j at a time up to this block's last row
    for j0 in range(0, tl.minimum((pid_i + 1) * BLOCK_I, Q), BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)
        t_j = ci * Q + o_j
        m_j = (o_j < Q) & (t_j < T)
        b_B = tl.load(B_ptr + t_j[:, None].to(tl.int64) * sb_t + g * N + o_n[None, :],
                      mask=m_j[:, None] & m_n[None, :], other=0.0)
        b_sj = tl.load(acs_ptr + t_j * nh + h, mask=m_j, other=0.0)
        b_dt = tl.load(dt_ptr + t_j * nh + h, mask=m_j, other=0.0)
        b_x = tl.load(x_ptr + t_j[:, None].to(tl.int64) * sx_t + h * hd + o_d[None, :],
                      mask=m_j[:, None] & m_d[None, :], other=0.0)
        b_cb = _exact_dot(b_C, tl.trans(b_B), tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32), UPCAST)
        causal = (o_i[:, None] >= o_j[None, :]) & m_i[:, None] & m_j[None, :]
        # above the diagonal (and on padding rows, s_i = 0) s_i - s_j >= 0 and exp could overflow: -inf first, so
        # exp gives 0 (never inf · 0)
        b_w = b_cb * tl.exp(tl.where(causal, b_si[:, None] - b_sj[None, :], -float("inf"))) * b_dt[None, :]
        acc = _split_dot(b_w, b_x, acc, SPLIT, UPCAST)
    b_xi = tl.load(x_ptr + t_i[:, None].to(tl.int64) * sx_t + h * hd + o_d[None, :], mask=m_i[:, None] & m_d[None, :],
                   other=0.0)
    acc += tl.load(D_ptr + h) * b_xi.to(tl.float32)
    tl.store(y_ptr + t_i[:, None].to(tl.int64) * (nh * hd) + h * hd + o_d[None, :], acc,
             mask=m_i[:, None] & m_d[None, :])


def _check(x, dt, A, B, C, D, state, chunk_size):
    _check_scan(x, dt, A, B, C, state, chunk_size)
    if D.shape != A.shape or D.dtype != torch.float32:
        raise ValueError(f"D must be fp32 [{A.shape[0]}], got {D.dtype} {tuple(D.shape)}")


# The output kernel's blocks and warps, the state kernel's warps at Q >= 128 and its block of N (a third grid axis
# when smaller than N: fewer registers, x read once a block), and the split (see the module's note);
# bench/kernels/mamba_ssd.py times others beside these on the GPU
CONFIG = dict(BLOCK_I=64, BLOCK_J=32, num_warps=4, num_stages=2, state_warps=8, state_block_n=128, SPLIT=True)


def ssd_scan(x, dt, A, B, C, D, state, chunk_size: int, taps: dict | None = None, config: dict | None = None):
    """The kernels: x [T, nh, hd], B/C [T, ng, N] bf16 with contiguous inner dims (rows may be strided: the mixer's
    views of its conv output), dt [T, nh], A [nh], D [nh], state [nh, hd, N] fp32 -> (y [T, nh, hd] fp32 with D·x
    added, new state). `state` is not modified; `taps` as in kernels.mamba_scan.chunk_scan. `config`: keys of
    CONFIG to override."""
    _check(x, dt, A, B, C, D, state, chunk_size)
    for name, t in (("x", x), ("B", B), ("C", C)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bf16 (its products are exact in fp32 only then), got {t.dtype}")
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"{name}: its last two dims must be contiguous (rows may be strided)")
    T, nh, hd = x.shape
    ng, N = B.shape[1:]
    Q = min(chunk_size, T)
    c = triton.cdiv(T, Q)
    dt, A, D = dt.contiguous(), A.contiguous(), D.contiguous()
    dev = x.device
    acs = torch.empty(T, nh, device=dev)                      # s_i per chunk, for the output kernel and the taps
    decay = torch.empty(c, nh, device=dev)                    # exp(s_Q): each chunk's total decay
    states = torch.empty(c, nh, hd, N, device=dev)
    block_q = max(16, triton.next_power_of_2(Q))
    block_d, block_n = max(16, triton.next_power_of_2(hd)), max(16, triton.next_power_of_2(N))
    cfg = {**CONFIG, **(config or {})}
    split, state_warps = cfg.pop("SPLIT"), cfg.pop("state_warps")
    state_n = max(16, min(block_n, cfg.pop("state_block_n")))
    _ssd_state_kernel[(c, nh, triton.cdiv(N, state_n))](
        x, dt, A, B, acs, decay, states, T, Q, nh, hd, N, nh // ng, x.stride(0), B.stride(0),
        BLOCK_Q=block_q, BLOCK_D=block_d, BLOCK_N=state_n, SPLIT=split, UPCAST=_UPCAST,
        num_warps=state_warps if block_q >= 128 else 4)
    S_in = torch.empty_like(states)
    S = _carry(states, state, decay, S_in)
    del states
    if taps:
        at = sorted(int(t) for t in taps)
        if any(not 0 < t < T for t in at):
            raise ValueError(f"taps {at} must lie inside the {T} tokens (0 < t < T)")
        for t in at:
            q, j = divmod(t, Q)
            e = min(T, (q + 1) * Q)
            taps[t] = S_in[q].clone() if j == 0 else _state_at(x[q * Q:e], dt[q * Q:e], B[q * Q:e], acs[q * Q:e],
                                                               S_in[q], j)
    cfg["BLOCK_I"] = min(cfg["BLOCK_I"], block_q)
    cfg["BLOCK_J"] = min(cfg["BLOCK_J"], cfg["BLOCK_I"])
    y = torch.empty(T, nh, hd, device=dev)
    _ssd_out_kernel[(triton.cdiv(Q, cfg["BLOCK_I"]), nh, c)](
        x, dt, acs, B, C, S_in, D, y, T, Q, nh, hd, N, nh // ng, x.stride(0), B.stride(0), C.stride(0),
        BLOCK_D=block_d, BLOCK_N=block_n, SPLIT=split, UPCAST=_UPCAST, **cfg)
    return y, S


def ssd_scan_torch(x, dt, A, B, C, D, state, chunk_size: int, taps: dict | None = None):
    """The twin: kernels.mamba_scan.chunk_scan, then + D·x as the mixer adds it. Same arguments and results as
    `ssd_scan` (any float dtype of x, B, C)."""
    _check(x, dt, A, B, C, D, state, chunk_size)
    y, S = chunk_scan(x, dt, A, B, C, state, chunk_size, **({"taps": taps} if taps else {}))
    return y + D[:, None] * x, S


def ssd_bytes(tokens: int, nh: int, hd: int, N: int, chunk_size: int) -> int:
    """Peak bytes that `ssd_scan` allocates for `tokens` tokens: s_i, the chunk decays, the chunk states and the
    states they start from, the new state, then y (the chunk states are freed before y). A piece of 4,096 tokens
    at Super's shape: 262 MiB (kernels.mamba_scan.scan_bytes: 690 MiB)."""
    c = -(-tokens // min(chunk_size, tokens))
    state = 4 * nh * hd * N
    acs, decay = 4 * tokens * nh, 4 * c * nh
    return acs + decay + max(2 * c * state + state, c * state + state + 4 * tokens * nh * hd)
