"""The NVFP4 GEMV inner loops that lost (kept to be re-measured and not re-invented; llm.c's dev/cuda habit).

Timings are H200, 18,560 x 4,096, graph-replayed medians from bench/NOTES.md; the winners (modes 8 and 9) are
in kernels/gemv_nvfp4.py. Same contract: y = x @ W.T, x in fp16 prescaled by 2^-8, fp32 accumulation.
  0  bytes + interleave (tl.join + reshape), x block-diagonal: 64-66 us at M = 1 (16 % of HBM). Lost to mode 3 by
     ~10 %: the interleave costs shuffles.
  1  as 0, each element loading its own byte: 528 us (2 %). 8x the load instructions.
  2  as 0 through tl.dot_scaled(e2m1): 143 us (7 %). Triton's upcast on Hopper is software, 2x the hand decode.
  3  low and high nibbles in two dots against x's even and odd elements, x gathered block-diagonal per tile:
     58.4 us (18 %), the default until issue 19. ~9.4 instructions per weight (ncu): Triton lowers the uint8
     decode one value per 32-bit register (IMAD/PRMT/LOP3 per nibble), plus the masked x gather per tile.
  4  scales on the decoded tile, x.T as a plain 16-column B: 62-66 us at M = 1-8 (16 %), the M > 1 default until
     issue 19; still the up kernel's LOAD_MODE 4 (kernels/expert_up.py: `_gemv_rows_scaled`).
  5  weights as e4m3 (1 byte per value into the tensor cores), x split per tile into three e4m3 parts:
     227-1,120 us. Every program re-splits its x tile and the fp32 -> e4m3 B tile is stored with 3.6 M
     shared-memory bank conflicts (ncu: 81 instructions per weight).
  6  mode 3 with the decode as inline PTX on bytes (a prmt lookup of fp16 high bytes: 8 codes in 17
     instructions) and x spread into B by a select: 45.9 us (22 %). Triton unpacks and repacks the uint8 tile byte
     by byte around the asm (PRMT 0x7770 / 0x3340 pairs): 7.0 instructions per weight in the SASS loop.
  7  mode 4 with the same lookup: 46.4 us at M = 8 (22 %); 7.7 instructions per weight.
Modes 8/9 read the tile as int16 (no byte unpacking), decode 2 weights in 4 instructions and load a prepared B
whole: 2.9-3.8 instructions per weight, 24.8 us at M = 1.

    python -m bench.kernels.run_all --only lost     # (GPU) re-times modes 0, 2, 3, 5, 6 at M = 1 beside the winner
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.expert_up import _gemv_rows_scaled
from kernels.gemv_nvfp4 import _UNDO_DECODE, _X_PRESCALE, _as_u8, _e2m1_to_fp16, _global

LOST_MODES = (0, 1, 2, 3, 4, 5, 6, 7)


# e2m1 -> fp16 for 8 codes (4 bytes) in 17 instructions: the magnitude is a byte lookup (prmt into a table of
# fp16 high bytes: 0, 0.5, 1, 1.5, 2, 3, 4, 6 -> 0x00 0x38 0x3C 0x3E 0x40 0x42 0x44 0x46; the low byte is 0), the
# sign a second prmt that replicates each code's sign bit (bit 3 of the nibble, the msb of its byte after a shift
# by 0 or 4) into the fp16 sign, merged by one lop3. $4 holds bytes b0..b3; $0/$1 = low nibbles (b0, b1)/(b2, b3),
# $2/$3 = high nibbles, each an fp16 pair equal to the e2m1 value exactly. Checked bit for bit against the table
# in tests/bench/test_gemv_nvfp4_modes.py (a Python model of the same instructions).
_E2M1_ASM = tl.constexpr("""{
.reg .b32 r4, t, t4, u, m, s, l0, l1;
mov.b32 l0, 0x3E3C3800;
mov.b32 l1, 0x46444240;
shl.b32 r4, $4, 4;
and.b32 t, $4, 0x70707070;
and.b32 t4, r4, 0x70707070;
prmt.b32 m, l0, l1, t4;
prmt.b32 s, r4, r4, 0x9080;
lop3.b32 $0, m, s, 0x80008000, 0xF8;
shr.u32 u, t4, 16;
prmt.b32 m, l0, l1, u;
prmt.b32 s, r4, r4, 0xB0A0;
lop3.b32 $1, m, s, 0x80008000, 0xF8;
prmt.b32 m, l0, l1, t;
prmt.b32 s, $4, $4, 0x9080;
lop3.b32 $2, m, s, 0x80008000, 0xF8;
shr.u32 u, t, 16;
prmt.b32 m, l0, l1, u;
prmt.b32 s, $4, $4, 0xB0A0;
lop3.b32 $3, m, s, 0x80008000, 0xF8;
}""")


@triton.jit
def _e2m1_pairs(b_w, USE_ASM: tl.constexpr):
    """U8 bytes -> (low-nibble, high-nibble) values as fp16, each equal to its e2m1 value exactly.

    USE_ASM: the byte-permute lookup above (compiled code only); otherwise (Triton's interpreter) the bit moves
    of `_e2m1_to_fp16` times 2^14 — the same numbers."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_ASM, "=r,=r,=r,=r,r", [b_w], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
    else:
        lo = (_e2m1_to_fp16(b_w & 15).to(tl.float32) * 16384.0).to(tl.float16)
        hi = (_e2m1_to_fp16(b_w >> 4).to(tl.float32) * 16384.0).to(tl.float16)
    return lo, hi


@triton.jit
def _gemv_rows_lut(x_ptr, stride_xm, M, w_ptr, s_ptr, row_bytes, row_scales, o_n, m_n, k_lo, k_hi,
                   M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """LOAD_MODE 6: mode 3's contract (block-diagonal x, each e4m3 scale applied once per 16-group after the dot)
    with the lookup decode, and x loaded once per tile ([M_PAD, BLOCK_K/2] even and odd elements) then spread
    into the block-diagonal B by a select instead of a masked gather. Returns fp32 [BLOCK_N, M_PAD] times 2^-8."""
    G: tl.constexpr = BLOCK_K // 16
    o_j = tl.arange(0, BLOCK_K // 2)
    o_m = tl.arange(0, M_PAD)
    o_g = tl.arange(0, G)
    K = row_bytes * 2
    diag = (o_j[:, None, None] // 8) == o_g[None, None, :]                  # [BK/2, 1, G]
    b_acc = tl.zeros([BLOCK_N, M_PAD * G], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_b = k0 // 2 + o_j
        b_w = tl.load(w_ptr + o_n[:, None] * row_bytes + o_b[None, :],
                      mask=m_n[:, None] & (o_b[None, :] < row_bytes), other=0)
        k_e = k0 + 2 * o_j
        m_x = (o_m[None, :] < M) & (k_e[:, None] < K)
        x_e = tl.load(x_ptr + o_m[None, :] * stride_xm + k_e[:, None], mask=m_x, other=0.0)     # [BK/2, M_PAD]
        x_o = tl.load(x_ptr + o_m[None, :] * stride_xm + k_e[:, None] + 1, mask=m_x, other=0.0)
        x_e = (x_e.to(tl.float32) * _X_PRESCALE).to(tl.float16)
        x_o = (x_o.to(tl.float32) * _X_PRESCALE).to(tl.float16)
        b_e = tl.reshape(tl.where(diag, x_e[:, :, None], 0.0), (BLOCK_K // 2, M_PAD * G))
        b_o = tl.reshape(tl.where(diag, x_o[:, :, None], 0.0), (BLOCK_K // 2, M_PAD * G))
        lo, hi = _e2m1_pairs(b_w, USE_ASM)
        b_r = tl.dot(lo, b_e)
        b_r = tl.dot(hi, b_o, b_r)
        o_gs = k0 // 16 + (tl.arange(0, M_PAD * G) % G)
        b_s = tl.load(s_ptr + o_n[:, None] * row_scales + o_gs[None, :],
                      mask=m_n[:, None] & (o_gs[None, :] < row_scales), other=0)
        b_acc += b_r * b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.sum(b_acc.reshape(BLOCK_N, M_PAD, G), axis=2)


@triton.jit
def _gemv_rows_lut_scaled(x_ptr, stride_xm, M, w_ptr, s_ptr, K, o_n, m_n, k_lo, k_hi,
                          M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """LOAD_MODE 7: mode 4 (scales on the decoded tile, x.T as a plain 16-column B) with the lookup decode.
    Same contract and 2^-8 factor as `_gemv_rows_lut`."""
    SPREAD: tl.constexpr = 16 // M_PAD
    o_c = tl.arange(0, 16)
    c_row = o_c // SPREAD
    m_c = ((o_c % SPREAD) == 0) & (c_row < M)
    o_j = tl.arange(0, BLOCK_K // 2)
    b_acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a_lo, a_hi = _nvfp4_tile_lut(w_ptr, s_ptr, o_n, m_n, k0, K, 0, 0, BLOCK_K, USE_ASM)
        k_e = k0 + 2 * o_j
        m_x = m_c[None, :] & (k_e[:, None] < K)
        x_e = tl.load(x_ptr + c_row[None, :] * stride_xm + k_e[:, None], mask=m_x, other=0.0)
        x_o = tl.load(x_ptr + c_row[None, :] * stride_xm + k_e[:, None] + 1, mask=m_x, other=0.0)
        b_acc = tl.dot(a_lo, (x_e.to(tl.float32) * _X_PRESCALE).to(tl.float16), b_acc)
        b_acc = tl.dot(a_hi, (x_o.to(tl.float32) * _X_PRESCALE).to(tl.float16), b_acc)
    return tl.sum(b_acc.reshape(BLOCK_N, M_PAD, SPREAD), axis=2)


@triton.jit
def _nvfp4_tile_lut(w_ptr, s_ptr, o_n, m_n, k0, K, N, LAYOUT: tl.constexpr, BLOCK_K: tl.constexpr,
                    USE_ASM: tl.constexpr):
    """`_nvfp4_tile_split` with the lookup decode: values e2m1 · scale exactly (no 2^-7 factor)."""
    o_j = tl.arange(0, BLOCK_K // 2)
    kb = k0 // 2 + o_j
    o_g = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    if LAYOUT == 0:
        p_w = w_ptr + o_n[:, None] * (K // 2) + kb[None, :]
        p_s = s_ptr + o_n[:, None] * (K // 16) + o_g[None, :]
    else:
        p_w = w_ptr + (kb // 8)[None, :] * (9 * N) + o_n[:, None] * 8 + (kb % 8)[None, :]
        p_s = s_ptr + o_g[None, :] * (9 * N) + 8 * N + o_n[:, None]
    b_w = tl.load(p_w, mask=m_n[:, None] & (kb[None, :] < K // 2), other=0)
    b_s = tl.load(p_s, mask=m_n[:, None] & (o_g[None, :] < K // 16), other=0)
    b_s = b_s.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (b_s.shape[0], BLOCK_K // 16, 8)), (b_s.shape[0], BLOCK_K // 2))
    lo, hi = _e2m1_pairs(b_w, USE_ASM)
    return lo * b_s, hi * b_s


@triton.jit
def _gemv_rows(x_ptr, stride_xm, M, w_ptr, s_ptr, row_bytes, row_scales, o_n, m_n, k_lo, k_hi,
               M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """LOAD_MODE 3: Σ_k x[m, k] · code[n, k] · scale[n, k/16] over k in [k_lo, k_hi), for M <= M_PAD rows of x.

    w_ptr / s_ptr: U8 pointers to row-major values [*, row_bytes] and e4m3 scales [*, row_scales]. Even codes
    (low nibbles) and odd codes (high) go through two dots against x's even and odd elements (no interleave),
    B block-diagonal: column c holds row c // G of x restricted to 16-group c % G of the tile.
    Returns fp32 [BLOCK_N, M_PAD], still times 2^-22 (see _UNDO_DECODE), global scale not applied.
    """
    G: tl.constexpr = BLOCK_K // 16
    NCOL: tl.constexpr = M_PAD * G
    o_c = tl.arange(0, NCOL)
    c_m = o_c // G
    c_g = o_c % G
    o_j = tl.arange(0, BLOCK_K // 2)
    K = row_bytes * 2
    b_acc = tl.zeros([BLOCK_N, NCOL], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_b = k0 // 2 + o_j
        b_w = tl.load(w_ptr + o_n[:, None] * row_bytes + o_b[None, :],
                      mask=m_n[:, None] & (o_b[None, :] < row_bytes), other=0)
        k_e = k0 + 2 * o_j
        m_e = (c_m[None, :] < M) & ((o_j[:, None] // 8) == c_g[None, :]) & (k_e[:, None] < K)
        x_e = tl.load(x_ptr + c_m[None, :] * stride_xm + k_e[:, None], mask=m_e, other=0.0)
        x_o = tl.load(x_ptr + c_m[None, :] * stride_xm + k_e[:, None] + 1, mask=m_e, other=0.0)
        x_e = (x_e.to(tl.float32) * _X_PRESCALE).to(tl.float16)
        x_o = (x_o.to(tl.float32) * _X_PRESCALE).to(tl.float16)
        b_r = tl.dot(_e2m1_to_fp16(b_w & 15), x_e)
        b_r = tl.dot(_e2m1_to_fp16(b_w >> 4), x_o, b_r)
        o_g = k0 // 16 + c_g
        b_s = tl.load(s_ptr + o_n[:, None] * row_scales + o_g[None, :],
                      mask=m_n[:, None] & (o_g[None, :] < row_scales), other=0)
        b_acc += b_r * b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.sum(b_acc.reshape(BLOCK_N, M_PAD, G), axis=2)




@triton.jit
def _gemv_rows_modes(x_ptr, stride_xm, M, w_ptr, s_ptr, row_bytes, row_scales, o_n, m_n, k_lo, k_hi,
               M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOAD_MODE: tl.constexpr):
    """Σ_k x[m, k] · code[n, k] · scale[n, k/16] over k in [k_lo, k_hi), for M <= M_PAD rows of x.

    w_ptr / s_ptr: U8 pointers to row-major values [*, row_bytes] and e4m3 scales [*, row_scales].
    LOAD_MODE 0: byte loads + interleave; 1: each element loads its byte; 2: tl.dot_scaled (x as bf16).
    Returns fp32 [BLOCK_N, M_PAD], still times 2^-22 (see _UNDO_DECODE), global scale not applied.
    """
    G: tl.constexpr = BLOCK_K // 16
    NCOL: tl.constexpr = M_PAD * G
    o_c = tl.arange(0, NCOL)
    c_m = o_c // G                      # column c of B holds row c_m of x restricted to group c_g
    c_g = o_c % G
    o_kk = tl.arange(0, BLOCK_K)
    K = row_bytes * 2
    b_acc = tl.zeros([BLOCK_N, NCOL], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_k = k0 + o_kk
        if LOAD_MODE != 1:
            # one byte per two codes, then interleave: element 2j = low nibble, 2j+1 = high nibble
            o_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b_w = tl.load(w_ptr + o_n[:, None] * row_bytes + o_b[None, :],
                          mask=m_n[:, None] & (o_b[None, :] < row_bytes), other=0)
            codes = tl.join(b_w & 15, b_w >> 4).reshape(BLOCK_N, BLOCK_K)
        else:
            # each element loads its own byte (cached) and shifts: an elementwise chain, no reshape
            b_w = tl.load(w_ptr + o_n[:, None] * row_bytes + (o_k // 2)[None, :],
                          mask=m_n[:, None] & (o_k[None, :] < K), other=0)
            codes = (b_w >> ((o_k & 1) * 4).to(tl.uint8)[None, :]) & 15
        if True:
            m_b = (c_m[None, :] < M) & ((o_kk[:, None] // 16) == c_g[None, :]) & (o_k[:, None] < K)
            b_x = tl.load(x_ptr + c_m[None, :] * stride_xm + o_k[:, None], mask=m_b, other=0.0)
        if LOAD_MODE == 2:
            # Triton's own e2m1 operand path (upcast to bf16 inside dot_scaled); x as bf16, no prescale
            b_r = tl.dot_scaled(b_w, None, "e2m1", b_x.to(tl.bfloat16), None, "bf16") * (1.0 / _UNDO_DECODE)
        else:
            b_x = (b_x.to(tl.float32) * _X_PRESCALE).to(tl.float16)
            b_r = tl.dot(_e2m1_to_fp16(codes), b_x)              # [BLOCK_N, NCOL]: per (row, x row, group)
        o_g = k0 // 16 + c_g
        b_s = tl.load(s_ptr + o_n[:, None] * row_scales + o_g[None, :],
                      mask=m_n[:, None] & (o_g[None, :] < row_scales), other=0)
        b_acc += b_r * b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.sum(b_acc.reshape(BLOCK_N, M_PAD, G), axis=2)


@triton.jit
def _to_e4m3_value(v):
    """v (|v| <= 448) rounded to an e4m3 value, as fp32: 4 significant bits, grid 2^-9 at the bottom.

    Rounded by hand, then through the hardware cast, which is then exact (the interpreter's fp32 -> e4m3
    cast is wrong when rounding carries into the exponent: -7.9989 -> -4).
    """
    q = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(v), 1e-30))) - 3.0, -9.0))
    return (tl.floor(v / q + 0.5) * q).to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _gemv_rows_fp8tc(x_ptr, w_ptr, s_ptr, K, o_n, m_n, k_lo, k_hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """LOAD_MODE 5 (one row of x): the weights enter the tensor cores as e4m3, 1 byte per value instead of 2.

    e2m1 -> e4m3 is again bit moves: (c&7)<<2 | (c&8)<<4 is e2m1 · 2^-6 exactly (e4m3's subnormals cover 0.5).
    x cannot be one e4m3 (4 significant bits), so each tile of x is scaled to |x·S| <= 240 and split into three
    e4m3 parts, x·S = p0 + p1/16 + p2/256 (about 12 bits), laid block-diagonally: column (part, group).
    Same contract and 2^-22 factor as `_gemv_rows`.
    """
    G: tl.constexpr = BLOCK_K // 16
    NCOL: tl.constexpr = 4 * G
    o_c = tl.arange(0, NCOL)
    c_p = o_c // G                      # which part of x (3 = unused, zero)
    c_g = o_c % G
    fac = tl.where(c_p == 0, 1.0, tl.where(c_p == 1, 1.0 / 16.0, tl.where(c_p == 2, 1.0 / 256.0, 0.0)))
    o_j = tl.arange(0, BLOCK_K // 2)
    b_acc = tl.zeros([BLOCK_N, NCOL], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kb = k0 // 2 + o_j
        b_w = tl.load(w_ptr + o_n[:, None] * (K // 2) + kb[None, :], mask=m_n[:, None] & (kb[None, :] < K // 2), other=0)
        a_lo = (((b_w & 7) << 2) | ((b_w & 8) << 4)).to(tl.float8e4nv, bitcast=True)
        a_hi = ((((b_w >> 4) & 7) << 2) | ((b_w >> 4) & 8) << 4).to(tl.float8e4nv, bitcast=True)
        k_e = k0 + 2 * o_j
        x_e = tl.load(x_ptr + k_e, mask=k_e < K, other=0.0).to(tl.float32)
        x_o = tl.load(x_ptr + k_e + 1, mask=k_e < K, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x_e), axis=0), tl.max(tl.abs(x_o), axis=0))
        sx = tl.where(amax > 0, 240.0 / amax, 1.0)
        b_r = tl.zeros([BLOCK_N, NCOL], dtype=tl.float32)
        for half in tl.static_range(2):
            v = (x_e if half == 0 else x_o) * sx
            p0 = _to_e4m3_value(v)
            r1 = (v - p0) * 16.0
            p1 = _to_e4m3_value(r1)
            p2 = _to_e4m3_value((r1 - p1) * 16.0)
            part = tl.where(c_p[None, :] == 0, p0[:, None], tl.where(c_p[None, :] == 1, p1[:, None], p2[:, None]))
            b_x = tl.where(((o_j[:, None] // 8) == c_g[None, :]) & (c_p[None, :] < 3), part, 0.0).to(tl.float8e4nv)
            b_r = tl.dot(a_lo if half == 0 else a_hi, b_x, b_r)
        o_g = k0 // 16 + c_g
        b_s = tl.load(s_ptr + o_n[:, None] * (K // 16) + o_g[None, :], mask=m_n[:, None] & (o_g[None, :] < K // 16),
                      other=0)
        b_acc += b_r * (b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (fac / sx)[None, :])
    return tl.sum(b_acc, axis=1)[:, None] * (1.0 / 65536.0)   # 2^6 (e4m3 decode) · 2^-22 (contract)


@triton.jit
def _gemv_modes_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                       M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       LOAD_MODE: tl.constexpr, USE_ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if LOAD_MODE == 5:
        b_y = _gemv_rows_fp8tc(x_ptr, w_ptr, s_ptr, K, o_n, m_n, k_lo, k_hi, BLOCK_N, BLOCK_K) * _UNDO_DECODE
    elif LOAD_MODE == 3:
        b_y = _gemv_rows(x_ptr, stride_xm, M, w_ptr, s_ptr, K // 2, K // 16, o_n, m_n, k_lo, k_hi, M_PAD, BLOCK_N,
                         BLOCK_K) * _UNDO_DECODE
    elif LOAD_MODE == 4:
        b_y = _gemv_rows_scaled(x_ptr, stride_xm, M, w_ptr, s_ptr, K, o_n, m_n, k_lo, k_hi, M_PAD, BLOCK_N,
                                BLOCK_K) * _UNDO_DECODE
    elif LOAD_MODE == 6:
        b_y = _gemv_rows_lut(x_ptr, stride_xm, M, w_ptr, s_ptr, K // 2, K // 16, o_n, m_n, k_lo, k_hi, M_PAD, BLOCK_N,
                             BLOCK_K, USE_ASM) * 256.0
    elif LOAD_MODE == 7:
        b_y = _gemv_rows_lut_scaled(x_ptr, stride_xm, M, w_ptr, s_ptr, K, o_n, m_n, k_lo, k_hi, M_PAD, BLOCK_N,
                                    BLOCK_K, USE_ASM) * 256.0
    else:
        b_y = _gemv_rows_modes(x_ptr, stride_xm, M, w_ptr, s_ptr, K // 2, K // 16, o_n, m_n, k_lo, k_hi,
                               M_PAD, BLOCK_N, BLOCK_K, LOAD_MODE) * _UNDO_DECODE
    b_y = b_y * tl.load(gs_ptr)
    o_m = tl.arange(0, M_PAD)
    p_y = y_ptr + o_m[None, :] * stride_ym + o_n[:, None]
    m_y = m_n[:, None] & (o_m[None, :] < M)
    if SPLIT_K == 1:
        tl.store(p_y, b_y, mask=m_y)
    else:
        tl.atomic_add(p_y, b_y, mask=m_y)


def nvfp4_linear_mode(x, weight_u8, weight_scale_e4m3, global_scale, mode: int, block_n: int = 64,
                      block_k: int | None = None, split_k: int = 1, num_warps: int = 4, num_stages: int = 3):
    """y fp32 [M, N] = x [M, K] @ W.T through one of the lost inner loops (mode 5: M = 1 only)."""
    if mode not in LOST_MODES:
        raise ValueError(f"mode {mode}: the lost modes are {LOST_MODES}")
    N, K = weight_u8.shape[0], weight_u8.shape[1] * 2
    M = x.shape[0]
    if mode == 5 and M != 1:
        raise ValueError("mode 5 takes one row of x")
    m_pad = triton.next_power_of_2(M)
    if block_k is None:
        block_k = 128 if mode == 5 else 256
    if mode in (0, 1, 2, 3, 6):  # block-diagonal B has M_PAD * BLOCK_K / 16 columns: at least 16
        block_k = max(block_k, 256 // m_pad)
    x = x.contiguous()
    y = (torch.zeros if split_k > 1 else torch.empty)((M, N), dtype=torch.float32, device=x.device)
    _gemv_modes_kernel[(triton.cdiv(N, block_n), split_k)](
        x, weight_u8, _as_u8(weight_scale_e4m3), _global(global_scale, x.device), y, M, N, K, x.stride(0), y.stride(0),
        M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, LOAD_MODE=mode,
        USE_ASM=not backend.interpreted(), num_warps=num_warps, num_stages=num_stages)
    return y


def run(ctx) -> list[dict]:
    """Each lost mode at the big shape, M = 1, beside the winner, timed in the same run (run_all section)."""
    from bench.kernels.common import DEV, time_graph
    from bench.kernels.gemv_nvfp4 import _bytes, _copies, _rand_nvfp4
    from kernels.gemv_nvfp4 import nvfp4_linear, nvfp4_linear_torch
    from kernels.testing import rel_err
    hbm = ctx["ceil"]["d2d_GBps"] * 1e9
    N, K = ctx.get("big", (18560, 4096))
    copies = _copies(_bytes(N, K, 1))
    ws = _rand_nvfp4(N, K, copies)
    x = torch.randn(1, K, device=DEV).bfloat16()
    rows = []
    ref = nvfp4_linear_torch(x, *ws[0], out_dtype=torch.float32)
    for mode in ctx.get("lost_modes", (0, 2, 3, 5, 6)):   # mode 1 (528 us) is left out: it only costs time
        e = rel_err(nvfp4_linear_mode(x, *ws[0], mode=mode), ref)
        ctx["checks"].append(dict(check=f"lost gemv mode {mode} M=1 {N}x{K}", rel_err=e, ok=e < (1e-4 if mode == 5 else 1e-5)))
        sec = time_graph(lambda i: nvfp4_linear_mode(x, *ws[i % copies], mode=mode), 2 * copies)
        rows.append(dict(op="nvfp4 gemv lost mode", case=f"{N}x{K} M=1 mode {mode}", us=sec * 1e6,
                         bytes=_bytes(N, K, 1), GBps=_bytes(N, K, 1) / sec / 1e9, pct=100 * _bytes(N, K, 1) / sec / hbm))
    sec = time_graph(lambda i: nvfp4_linear(x, *ws[i % copies]), 2 * copies)
    rows.append(dict(op="nvfp4 gemv lost mode", case=f"{N}x{K} M=1 the winner (kernels' default)", us=sec * 1e6,
                     bytes=_bytes(N, K, 1), GBps=_bytes(N, K, 1) / sec / 1e9, pct=100 * _bytes(N, K, 1) / sec / hbm))
    return rows
