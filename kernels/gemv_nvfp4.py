"""Dense NVFP4 and FP8 linears: y = x @ W.T with W in its checkpoint precision, x [..., in] bf16/fp32.

Decode shape (1-8 rows): `_nvfp4_gemv_kernel`. The weight tile is read as int16 (4 e2m1 codes each) and
decoded per code position J by inline PTX, 4 instructions per two weights: two int16 share a 32-bit register,
so code J of both lies 16 bits apart and one shift serves both fp16 lanes; (c&7)<<9 | (c&8)<<12 holds
e2m1 * 2^-14 exactly. Products and sums run on the tensor cores (fp32 accumulation) against B_J = x at
k = 4i + J, x entering as fp16 prescaled by 2^-8 (headroom to |x| < 2^24), prepared once per call by
`_x_operands_kernel` (or gathered per tile, X_INLINE). Two ways to apply the e4m3 scales (LOAD_MODE):
  8  B_J block-diagonal (one column per x row x 16-group): each scale multiplies one fp32 number per group after
     the dot; up to 4 rows of x. Default at M = 1-2: in_proj 18,560 x 4,096 24.8 us (41 % of HBM; the per-nibble
     decode it replaces: 58.4 us), the 131,072-row lm_head size 102 us (71 %);
  9  scales on the decoded tile (e2m1 * scale is exact in fp16), B_J plain: any M <= 8; default at M = 3-8.
The modes that lost (0-7: per-element decodes, a prmt lookup on bytes, an e4m3 operand) are in
bench/kernels/gemv_nvfp4_modes.py with their timings; why each lost is in bench/NOTES.md.
The fixed cost per call (issue 19: 2-4 launches per GEMV), flags off by default until bench.kernels.gemv_nvfp4_sweep
has timed them (then GEMV_CHOICES picks per shape): X_BUILD (B built in the GEMV from x and a 0/1 pattern, no x
launch; 3.6-3.7 instructions per weight at BLOCK_N 64 against 3.4-3.5 prepared), SPLIT_REDUCE 1 (split-K partials
summed by the last split to arrive, y stored in its dtype: no zero-fill, no cast), ONE_DOT (one dot per K-tile),
`xb` (one x preparation for every GEMV of the same x).
Session 7 (bench.kernels.gemv_streamk_sweep / gemv_pdl_sweep, bench/NOTES.md "Session 7, h27"): STREAM_K=P
(`_nvfp4_gemv_sk_kernel`: one launch, P x SMs programs with equal shares of the flat (row block, K-tile) order,
shares that cut a row block joined by the last to arrive; GEMV_CHOICES' winner at M = 2-8: 1.1-2.8x over the
split-K launches there, no gain at M = 1), SCALE_AHEAD 1/2 and X_AHEAD (the scales / x values one or two K-tiles
ahead in registers: measured to lose, kept as flags for the record), PDL / PREFETCH (programmatic dependent launch:
the GEMV's programs start while the previous kernel drains; an L2 prefetch of the first weight tile before the wait).
Session 13 (h-fmaroute): at M = 1 on sm_90 six shapes (in_proj, out_proj, q/o, shared up / down, lm_head) leave the
tensor cores for kernels/gemv_nvfp4_fma.py (HFMA2 on the CUDA cores, 4-17 % faster there on the H200): their
GEMV_CHOICES entries carry an 'FMA' key that `nvfp4_linear` dispatches on; MOESTREAM_GEMV_FMA=0 drops those keys.
Decode FP8: `_fp8_gemv_kernel` (prepared x.T, direct e4m3 -> fp16) and its STREAM_K twin `_fp8_gemv_sk_kernel`
(FP8_GEMV_CHOICES: 8-28 % over it on the Super shapes). Session 36: at M = 1 on sm_90 every Super FP8 shape leaves
them for kernels/gemv_fp8_fma.py (the CUDA cores: one cvt per e4m3 pair, HFMA2) through the same 'FMA' key.
Prefill shape (a chunk of tokens): `_nvfp4_gemm_kernel` (e2m1 * scale exact in fp16, a plain tensor-core GEMM)
and `_fp8_gemm_kernel`, y stored in its dtype. Inside a forward's layer (spans of kernels.dense_prefill's
DEQUANT_MIN_ROWS rows on) the layer's weights are decoded once instead and multiplied by cuBLAS
(kernels/dense_prefill.py); these kernels remain for shorter spans and for callers outside a layer.

Twins: `nvfp4_linear_torch`, `fp8_linear_torch` (decode via kernels.nvfp4, then a matmul in fp32).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import backend
from kernels.nvfp4 import decode_fp8, decode_nvfp4

_X_PRESCALE = tl.constexpr(1.0 / 256.0)        # x * 2^-8 before the fp16 cast
_UNDO_DECODE = tl.constexpr(16384.0 * 256.0)   # 2^14 (e2m1 in fp16) * 2^8 (x prescale)


@triton.jit
def _e2m1_to_fp16(codes):
    """4-bit e2m1 codes -> fp16 equal to e2m1 * 2^-14 exactly. Bit 3 is the sign, bits 0-2 the magnitude."""
    c = codes.to(tl.int16)
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True)


# code J of both int16 halves of $1 -> fp16 pair e2m1 · 2^-14: magnitude (r << 9-4J) & 0x0E000E00, sign
# (r << 12-4J) & 0x80008000, merged by lop3 (a | (b & c) = 0xF8)
_QUAD_ASM0 = tl.constexpr("{.reg .b32 a, b; shl.b32 a, $1, 9; shl.b32 b, $1, 12; and.b32 a, a, 0x0E000E00; "
                          "lop3.b32 $0, a, b, 0x80008000, 0xF8;}")
_QUAD_ASM1 = tl.constexpr("{.reg .b32 a, b; shl.b32 a, $1, 5; shl.b32 b, $1, 8; and.b32 a, a, 0x0E000E00; "
                          "lop3.b32 $0, a, b, 0x80008000, 0xF8;}")
_QUAD_ASM2 = tl.constexpr("{.reg .b32 a, b; shl.b32 a, $1, 1; shl.b32 b, $1, 4; and.b32 a, a, 0x0E000E00; "
                          "lop3.b32 $0, a, b, 0x80008000, 0xF8;}")
_QUAD_ASM3 = tl.constexpr("{.reg .b32 a; shr.u32 a, $1, 3; and.b32 a, a, 0x0E000E00; "
                          "lop3.b32 $0, a, $1, 0x80008000, 0xF8;}")


@triton.jit
def _e2m1_quad(h, J: tl.constexpr, USE_ASM: tl.constexpr):
    """Code J (0-3) of each int16 (4 codes, low nibble first) -> fp16 equal to e2m1 · 2^-14 exactly.

    As inline PTX two int16 share a 32-bit register, so code J of both sits 16 bits apart and one shift per
    field serves both lanes: (r << 9-4J) & 0x0E000E00 is the magnitude, (r << 12-4J) & 0x80008000 the sign.
    Interpreter: the same bit moves through `_e2m1_to_fp16`."""
    if USE_ASM:
        if J == 0:
            v = tl.inline_asm_elementwise(_QUAD_ASM0, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
        elif J == 1:
            v = tl.inline_asm_elementwise(_QUAD_ASM1, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
        elif J == 2:
            v = tl.inline_asm_elementwise(_QUAD_ASM2, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
        else:
            v = tl.inline_asm_elementwise(_QUAD_ASM3, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
    else:
        v = _e2m1_to_fp16(((h >> (4 * J)) & 15).to(tl.uint8))
    return v


@triton.jit
def _b_operand(p_b, keep, J: tl.constexpr, row_q, X_INLINE: tl.constexpr):
    """B_J of one tile: from the prepared operands, or gathered from x (fp16, times 2^-8)."""
    if X_INLINE:
        v = (tl.load(p_b + J, mask=keep, other=0.0).to(tl.float32) * _X_PRESCALE).to(tl.float16)
    else:
        v = tl.load(p_b + J * row_q * 16, mask=keep, other=0.0)
    return v


@triton.jit
def _b_built(x_ptr, k0, J: tl.constexpr, M, stride_xm, K, d_pattern, M_PAD: tl.constexpr, Q: tl.constexpr):
    """B_J of one tile built from x itself (X_BUILD): only the M_PAD x Q values x[m, k0 + 4i + J] are loaded, spread
    over row m's 16 / M_PAD columns by a broadcast and multiplied by B's 0/1 pattern (exact in fp16). The pattern
    comes from a load (`x_pattern`) rather than from index arithmetic: its contiguous 2-D layout, 8 columns of one
    row per thread, is then the layout of the product too (one x value per thread at M = 1, one 16-byte shared
    store), where the computed pattern got a 1-column layout (~5.7 instructions per weight against 3.5; the counts
    per variant and Triton version: bench/kernels/gemv_nvfp4_sass.py, bench/NOTES.md)."""
    return _b_from_vals(_x_built_vals(x_ptr, k0, J, M, stride_xm, K, M_PAD, Q), d_pattern, M_PAD, Q)


@triton.jit
def _x_built_vals(x_ptr, k0, J: tl.constexpr, M, stride_xm, K, M_PAD: tl.constexpr, Q: tl.constexpr):
    """The x values `_b_built` spreads: x[m, k0 + 4i + J], [Q] at M_PAD 1, else [Q, M_PAD, 1] (as loaded)."""
    o_k = k0 + 4 * tl.arange(0, Q) + J
    if M_PAD == 1:
        v = tl.load(x_ptr + o_k, mask=o_k < K, other=0.0)
    else:
        o_m = tl.arange(0, M_PAD)
        v = tl.load(x_ptr + o_m[None, :, None] * stride_xm + o_k[:, None, None],
                    mask=(o_m[None, :, None] < M) & (o_k[:, None, None] < K), other=0.0)
    return v


@triton.jit
def _b_from_vals(v, d_pattern, M_PAD: tl.constexpr, Q: tl.constexpr):
    GC: tl.constexpr = 16 // M_PAD
    v = (v.to(tl.float32) * _X_PRESCALE).to(tl.float16)
    if M_PAD == 1:
        v = v[:, None] * d_pattern
    else:
        v = tl.reshape(tl.broadcast_to(v, (Q, M_PAD, GC)), (Q, 16)) * d_pattern
    return v


@triton.jit
def _pick4(J: tl.constexpr, a, b, c, d):
    if J == 0:
        v = a
    elif J == 1:
        v = b
    elif J == 2:
        v = c
    else:
        v = d
    return v


@triton.jit
def _b_tile(xb_ptr, p_b, keep, J: tl.constexpr, row_q, X_INLINE: tl.constexpr, X_BUILD: tl.constexpr, k0, M,
            stride_xm, K, M_PAD: tl.constexpr, Q: tl.constexpr):
    if X_BUILD:
        v = _b_built(xb_ptr, k0, J, M, stride_xm, K, keep, M_PAD, Q)
    else:
        v = _b_operand(p_b, keep, J, row_q, X_INLINE)
    return v


@triton.jit
def _scale_tile(s_ptr, o_n, m_n, k0, row_s, NCOL: tl.constexpr, G: tl.constexpr):
    """The raw e4m3 scales [BLOCK_N, NCOL] of the K-tile at k0: column c holds 16-group k0 / 16 + c mod G."""
    o_gs = k0 // 16 + (tl.arange(0, NCOL) % G)
    return tl.load(s_ptr + o_n[:, None] * row_s + o_gs[None, :], mask=m_n[:, None] & (o_gs[None, :] < row_s), other=0)


@triton.jit
def _gemv_rows_quad(xb_ptr, w_ptr, s_ptr, K, row_q, row_s, o_n, m_n, k_lo, k_hi, M_PAD: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_AFTER: tl.constexpr, USE_ASM: tl.constexpr,
                    X_INLINE: tl.constexpr = False, M=1, stride_xm=0, X_BUILD: tl.constexpr = False,
                    d_ptr=None, ONE_DOT: tl.constexpr = False, SCALE_AHEAD: tl.constexpr = 0,
                    X_AHEAD: tl.constexpr = False, SCALE_AT_TOP: tl.constexpr = False):
    """LOAD_MODE 8 (SCALE_AFTER) / 9: the weight tile read as int16 (4 codes each), decoded by code position J
    into four fp16 tiles [BLOCK_N, BLOCK_K/4], each against its own B_J [BLOCK_K/4, 16] = x at k = 4i + J,
    prepared once per call by `_x_operands_kernel` (fp16, times 2^-8; loaded whole, no gather or select here).
    SCALE_AFTER: B_J block-diagonal (column m·G + g holds x row m restricted to 16-group g of the tile, G = 16 /
    M_PAD), so the fp32 product holds one sum per (row, x row, group) and each e4m3 scale multiplies it once.
    Otherwise B_J's column m is x row m and the scales multiply the decoded tile (exact in fp16).
    X_INLINE: xb_ptr is x itself [M, K] and each tile's B_J is gathered here with `_x_operands_kernel`'s masks
    (no second launch: for short weights the launch costs more than the gather).
    X_BUILD: xb_ptr is x itself and B_J is built from x's values and the 0/1 pattern at d_ptr (`_b_built`): no
    second launch, and each program reads 2 bytes per k of x instead of 16 x 2 bytes of prepared operand.
    ONE_DOT (SCALE_AFTER): the four decoded J tiles joined back into k order and one dot over the K-tile with B in
    k order too (x itself with X_BUILD): 16 HGMMA and one wait per tile instead of four waits, for ~0.7 more
    instructions per weight (the join's byte permutes).
    row_q = K / 4 and row_s = K / 16 are passed as arguments (not derived from K in here) so that the launcher's
    divisibility-by-16 specialisation reaches them: 16-byte weight and 2-byte scale loads instead of 8 and 1.
    Returns fp32 [BLOCK_N, M_PAD] times 2^-22 (SCALE_AFTER) or 2^-15."""
    Q: tl.constexpr = BLOCK_K // 4
    G: tl.constexpr = 16 // M_PAD if SCALE_AFTER else BLOCK_K // 16
    o_i = tl.arange(0, Q)
    o_c = tl.arange(0, 16)
    GC: tl.constexpr = 16 // M_PAD
    c_row = o_c // GC
    w16 = w_ptr.to(tl.pointer_type(tl.int16))
    b_acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    if X_BUILD:     # B's 0/1 pattern [Q, 16], the same for every tile (see `_b_built` for why it is loaded)
        d_keep = tl.load(d_ptr + o_i[:, None] * 16 + o_c[None, :])
        if ONE_DOT:  # in k order: row r of the tile is row r // 4 of the pattern
            d_nat = tl.load(d_ptr + (tl.arange(0, BLOCK_K) // 4)[:, None] * 16 + o_c[None, :])
    # the e4m3 scales are a plain load that Triton does not put in the cp.async pipeline (they feed no dot): as loaded
    # in the iteration that uses them, every K-tile waits one DRAM round trip (SASS: LDG.E.64 ~100 instructions
    # before its use). SCALE_AHEAD 1 / 2 loads them one / two K-tiles ahead in registers (2 per thread per tile).
    NCOL: tl.constexpr = 16 if SCALE_AFTER else BLOCK_K // 16
    if SCALE_AHEAD >= 1:
        s_next = _scale_tile(s_ptr, o_n, m_n, k_lo, row_s, NCOL, G)
    if SCALE_AHEAD >= 2:
        s_next2 = _scale_tile(s_ptr, o_n, m_n, k_lo + BLOCK_K, row_s, NCOL, G)
    # X_AHEAD (X_BUILD, not ONE_DOT): the x values of the next tile loaded one iteration ahead, for the same reason
    if X_AHEAD:
        xn0 = _x_built_vals(xb_ptr, k_lo, 0, M, stride_xm, K, M_PAD, Q)
        xn1 = _x_built_vals(xb_ptr, k_lo, 1, M, stride_xm, K, M_PAD, Q)
        xn2 = _x_built_vals(xb_ptr, k_lo, 2, M, stride_xm, K, M_PAD, Q)
        xn3 = _x_built_vals(xb_ptr, k_lo, 3, M, stride_xm, K, M_PAD, Q)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if X_AHEAD:
            xv0 = xn0
            xv1 = xn1
            xv2 = xn2
            xv3 = xn3
            xn0 = _x_built_vals(xb_ptr, k0 + BLOCK_K, 0, M, stride_xm, K, M_PAD, Q)
            xn1 = _x_built_vals(xb_ptr, k0 + BLOCK_K, 1, M, stride_xm, K, M_PAD, Q)
            xn2 = _x_built_vals(xb_ptr, k0 + BLOCK_K, 2, M, stride_xm, K, M_PAD, Q)
            xn3 = _x_built_vals(xb_ptr, k0 + BLOCK_K, 3, M, stride_xm, K, M_PAD, Q)
        # SCALE_AT_TOP: the tile's scales loaded first in the iteration, as STREAM_K was measured (session 7, run 1);
        # the split kernel keeps its load after the dot, as sessions 5-6 measured it (the SASS of each is unchanged)
        if SCALE_AHEAD == 0 and SCALE_AT_TOP:
            b_s_raw = _scale_tile(s_ptr, o_n, m_n, k0, row_s, NCOL, G)
        elif SCALE_AHEAD == 1:
            b_s_raw = s_next
            s_next = _scale_tile(s_ptr, o_n, m_n, k0 + BLOCK_K, row_s, NCOL, G)
        elif SCALE_AHEAD == 2:
            b_s_raw = s_next
            s_next = s_next2
            s_next2 = _scale_tile(s_ptr, o_n, m_n, k0 + 2 * BLOCK_K, row_s, NCOL, G)
        o_q = k0 // 4 + o_i
        m_q = o_q < row_q
        b_h = tl.load(w16 + o_n[:, None] * row_q + o_q[None, :], mask=m_n[:, None] & m_q[None, :], other=0)
        if X_BUILD:
            keep = d_keep
            p_b = xb_ptr
        elif X_INLINE:
            if SCALE_AFTER:
                keep = (c_row[None, :] < M) & (((o_q[:, None] // 4) % GC) == (o_c % GC)[None, :]) & m_q[:, None]
            else:
                keep = (c_row[None, :] < M) & ((o_c % GC) == 0)[None, :] & m_q[:, None]
            p_b = xb_ptr + c_row[None, :] * stride_xm + 4 * o_q[:, None]
        else:
            keep = m_q[:, None]
            p_b = xb_ptr + o_q[:, None] * 16 + o_c[None, :]
        if SCALE_AFTER and ONE_DOT:
            # the four J tiles joined back into k order (k = 4i + J) and one dot over the whole K-tile
            a_nat = tl.reshape(tl.join(tl.join(_e2m1_quad(b_h, 0, USE_ASM), _e2m1_quad(b_h, 2, USE_ASM)),
                                       tl.join(_e2m1_quad(b_h, 1, USE_ASM), _e2m1_quad(b_h, 3, USE_ASM))),
                               (BLOCK_N, BLOCK_K))
            o_r = k0 + tl.arange(0, BLOCK_K)
            if X_BUILD and M_PAD == 1:
                b_nat = tl.load(xb_ptr + o_r, mask=o_r < K, other=0.0)
                b_nat = (b_nat.to(tl.float32) * _X_PRESCALE).to(tl.float16)[:, None] * d_nat
            elif X_BUILD:
                o_m = tl.arange(0, M_PAD)
                b_nat = tl.load(xb_ptr + o_m[None, :, None] * stride_xm + o_r[:, None, None],
                                mask=(o_m[None, :, None] < M) & (o_r[:, None, None] < K), other=0.0)
                b_nat = (b_nat.to(tl.float32) * _X_PRESCALE).to(tl.float16)
                b_nat = tl.reshape(tl.broadcast_to(b_nat, (BLOCK_K, M_PAD, GC)), (BLOCK_K, 16)) * d_nat
            else:
                b_nat = tl.load(xb_ptr + ((o_r % 4) * row_q + o_r // 4)[:, None] * 16 + o_c[None, :],
                                mask=(o_r < K)[:, None], other=0.0)
            b_r = tl.dot(a_nat, b_nat)
            if SCALE_AHEAD == 0 and not SCALE_AT_TOP:     # where it always was: after the dot
                b_s_raw = _scale_tile(s_ptr, o_n, m_n, k0, row_s, NCOL, G)
            b_acc += b_r * b_s_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif SCALE_AFTER and X_AHEAD:
            b_r = tl.dot(_e2m1_quad(b_h, 0, USE_ASM), _b_from_vals(xv0, keep, M_PAD, Q))
            for J in tl.static_range(1, 4):
                b_r = tl.dot(_e2m1_quad(b_h, J, USE_ASM), _b_from_vals(_pick4(J, xv0, xv1, xv2, xv3), keep, M_PAD, Q),
                             b_r)
            if SCALE_AHEAD == 0 and not SCALE_AT_TOP:     # where it always was: after the dot
                b_s_raw = _scale_tile(s_ptr, o_n, m_n, k0, row_s, NCOL, G)
            b_acc += b_r * b_s_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif SCALE_AFTER:
            b_r = tl.dot(_e2m1_quad(b_h, 0, USE_ASM),
                         _b_tile(xb_ptr, p_b, keep, 0, row_q, X_INLINE, X_BUILD, k0, M, stride_xm, K, M_PAD, Q))
            for J in tl.static_range(1, 4):
                b_r = tl.dot(_e2m1_quad(b_h, J, USE_ASM),
                             _b_tile(xb_ptr, p_b, keep, J, row_q, X_INLINE, X_BUILD, k0, M, stride_xm, K, M_PAD, Q),
                             b_r)
            if SCALE_AHEAD == 0 and not SCALE_AT_TOP:     # where it always was: after the dot
                b_s_raw = _scale_tile(s_ptr, o_n, m_n, k0, row_s, NCOL, G)
            b_acc += b_r * b_s_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            if SCALE_AHEAD == 0 and not SCALE_AT_TOP:     # as before the flag (`_scale_tile`'s modulo moves the SASS)
                o_g = k0 // 16 + tl.arange(0, G)
                b_s_raw = tl.load(s_ptr + o_n[:, None] * row_s + o_g[None, :],
                                  mask=m_n[:, None] & (o_g[None, :] < row_s), other=0)
            b_s = (b_s_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 128.0).to(tl.float16)
            b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_N, G, 4)), (BLOCK_N, Q))
            for J in tl.static_range(0, 4):
                # the decode before B's operand, as before X_AHEAD existed: the order shapes the SASS schedule
                if X_AHEAD:
                    b_acc = tl.dot(_e2m1_quad(b_h, J, USE_ASM) * b_s,
                                   _b_from_vals(_pick4(J, xv0, xv1, xv2, xv3), keep, M_PAD, Q), b_acc)
                else:
                    b_acc = tl.dot(_e2m1_quad(b_h, J, USE_ASM) * b_s,
                                   _b_tile(xb_ptr, p_b, keep, J, row_q, X_INLINE, X_BUILD, k0, M, stride_xm, K, M_PAD,
                                           Q), b_acc)
    return tl.sum(b_acc.reshape(BLOCK_N, M_PAD, 16 // M_PAD), axis=2)   # SCALE_AFTER: G == 16 // M_PAD too


@triton.jit
def _l2_prefetch(p):
    """prefetch.global.L2 of each address of p (a tensor of pointers); returns a dummy."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _pdl_enter(PDL: tl.constexpr, w_rows=None, PREFETCH: tl.constexpr = False):
    """PDL (programmatic dependent launch; the kernel launched with launch_pdl): this kernel's programs may start
    while the previous kernel on the stream drains; they wait for its writes (gdc_wait) before anything here reads or
    writes memory the previous kernel may touch, then let the next kernel launch (after the wait, so that at most one
    kernel's programs sit waiting). Only the weights (read-only) are touched before the wait: PREFETCH asks L2 for
    the first tile's rows (w_rows: one pointer per 128-byte line) meanwhile."""
    if PDL:
        if PREFETCH:
            _l2_prefetch(w_rows)
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _x_operands_kernel(x_ptr, xb_ptr, M, K, stride_xm, M_PAD: tl.constexpr, SCALE_AFTER: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """x [M, K] -> B_J [4, K/4, 16] fp16 (x · 2^-8) for `_gemv_rows_quad`: B_J[i, c] = x[m, 4i + J] where column c
    belongs to x row m (c // G = m, G = 16 / M_PAD) and, with SCALE_AFTER, to 16-group c % G = (i / 4) mod G of
    its tile (block-diagonal), without it only c % G = 0; else 0."""
    _pdl_enter(PDL)
    pid = tl.program_id(0)
    G: tl.constexpr = 16 // M_PAD
    o_i = pid * BLOCK + tl.arange(0, BLOCK)
    o_c = tl.arange(0, 16)
    m_i = o_i < K // 4
    if SCALE_AFTER:
        row = o_c // G
        keep = (row[None, :] < M) & (((o_i[:, None] // 4) % G) == (o_c % G)[None, :])
    else:   # row m in column m · 16/M_PAD (the others zero), as mode 4 lays out its B
        row = o_c // G
        keep = (row[None, :] < M) & ((o_c % G) == 0)[None, :] & (o_i[:, None] >= 0)
    for J in tl.static_range(4):
        v = tl.load(x_ptr + row[None, :] * stride_xm + 4 * o_i[:, None] + J, mask=keep & m_i[:, None], other=0.0)
        v = (v.to(tl.float32) * _X_PRESCALE).to(tl.float16)
        tl.store(xb_ptr + J * (K // 4) * 16 + o_i[:, None] * 16 + o_c[None, :], v, mask=m_i[:, None])


@triton.jit
def _nvfp4_tile_split(w_ptr, s_ptr, o_n, m_n, k0, K, N, LAYOUT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight tile as two fp16 halves [BLOCK_N, BLOCK_K/2]: even k (low nibbles) and odd k (high nibbles).

    Each value is e2m1 · scale · 2^-7, exact in fp16: (e2m1 · 2^-14 from bit moves) × (scale · 2^7, ≤ 57,344);
    the product has ≤ 6 significant bits and is a multiple of 2^-17, inside fp16's range and grid.
    LAYOUT 0: checkpoint row-major, values [N, K/2], scales [N, K/16].
    LAYOUT 1: the block's down groups (N = L rows, K = I neurons): group g = values [L, 8], scales [L].
    """
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
    b_s = (b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 128.0).to(tl.float16)
    b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (b_s.shape[0], BLOCK_K // 16, 8)), (b_s.shape[0], BLOCK_K // 2))
    return _e2m1_to_fp16(b_w & 15) * b_s, _e2m1_to_fp16(b_w >> 4) * b_s


@triton.jit
def _nvfp4_gemv_kernel(
    # tensors
    x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr,
    # sizes and strides
    M, N, K, stride_xm, stride_ym, row_q, row_s,
    # config
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    LOAD_MODE: tl.constexpr, USE_ASM: tl.constexpr = False, X_INLINE: tl.constexpr = False,
    X_BUILD: tl.constexpr = False, d_ptr=None, ONE_DOT: tl.constexpr = False, SCALE_AHEAD: tl.constexpr = 0,
    X_AHEAD: tl.constexpr = False, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
    # SPLIT_REDUCE 1: the split-K partials [splits, M, N] fp32 and one arrival counter per row block (int32, zero
    # on entry, left zero on exit); the splits are the grid's second dimension, SPLIT_K only says "> 1"
    part_ptr=None, cnt_ptr=None, SPLIT_REDUCE: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    if SPLIT_REDUCE == 1:   # the split count is the grid's: one compilation serves every count (SPLIT_K > 1)
        n_split = tl.num_programs(1)
    else:
        n_split = SPLIT_K
    k_per_split = tl.cdiv(K, n_split * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    _pdl_enter(PDL, w_ptr + tl.minimum(o_n, N - 1).to(tl.int64) * (2 * row_q) + k_lo // 2, PREFETCH)
    # x_ptr: the prepared B operands (x itself with X_INLINE or X_BUILD)
    b_y = _gemv_rows_quad(x_ptr, w_ptr, s_ptr, K, row_q, row_s, o_n, m_n, k_lo, k_hi, M_PAD, BLOCK_N, BLOCK_K,
                          LOAD_MODE == 8, USE_ASM, X_INLINE, M, stride_xm, X_BUILD, d_ptr, ONE_DOT, SCALE_AHEAD,
                          X_AHEAD)
    b_y = b_y * (tl.load(gs_ptr) * (_UNDO_DECODE if LOAD_MODE == 8 else 32768.0))
    o_m = tl.arange(0, M_PAD)
    p_y = y_ptr + o_m[None, :] * stride_ym + o_n[:, None]
    m_y = m_n[:, None] & (o_m[None, :] < M)
    if SPLIT_K == 1:
        tl.store(p_y, b_y, mask=m_y)
    elif SPLIT_REDUCE == 0:
        tl.atomic_add(p_y, b_y, mask=m_y, sem="relaxed")     # atomicity only: see kernels/expert_prefill.atomic_sem
    else:
        _split_reduce_last(b_y, part_ptr, cnt_ptr, p_y, m_y, o_n, o_m, pid_n, pid_k, M, N, n_split)


@triton.jit
def _split_reduce_last(b_y, part_ptr, cnt_ptr, p_y, m_y, o_n, o_m, pid_n, pid_k, M, N, n_split):
    """Split-K without a zero-filled output and a cast launch: each split stores its partial, the last of a row
    block's splits to arrive (an acq_rel counter) sums all partials in split order (the same sum whichever arrives
    last) and stores y in its own dtype, then puts the counter back to zero for the next call on this stream."""
    p_part = part_ptr + o_m[None, :] * N + o_n[:, None]
    tl.store(p_part + pid_k * M * N, b_y, mask=m_y)
    tl.debug_barrier()          # every thread's partial is issued before the program's arrival is counted
    arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == n_split - 1:
        b_sum = tl.zeros_like(b_y)
        for k in range(n_split):
            # .cg: from L2, where the other SMs' partials are (this SM's L1 is not coherent with them)
            b_sum += tl.load(p_part + k * M * N, mask=m_y, other=0.0, cache_modifier=".cg")
        tl.store(p_y, b_sum, mask=m_y)
        tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _stream_k_store(b_y, part_ptr, cnt_ptr, y_ptr, stride_ym, o_n, m_n, M, rb, lo, hi, n_tiles, per, pid, J_MAX,
                    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program's share [lo, hi) of row block rb's n_tiles K-tiles, summed into b_y [BLOCK_N, M_PAD]: stored as y
    when the share is the whole row, else as partial j of the row block (j = this program's rank among the programs
    whose tile ranges meet the row: programs own `per` consecutive tiles of the flattened (row block, K-tile) order,
    so they are pids p_lo .. p_hi); the last of them to arrive sums the partials in rank order (deterministic) and
    stores y in its dtype, then puts the row's counter back to zero for the next call on this stream."""
    o_m = tl.arange(0, M_PAD)
    p_y = y_ptr + o_m[None, :] * stride_ym + o_n[:, None]
    m_y = m_n[:, None] & (o_m[None, :] < M)
    if (lo == 0) & (hi == n_tiles):
        tl.store(p_y, b_y, mask=m_y)
    else:
        p_lo = (rb * n_tiles) // per
        n_parts = ((rb + 1) * n_tiles - 1) // per - p_lo + 1
        # partials [row blocks, J_MAX, M_PAD, BLOCK_N] fp32, written in full (no mask: the buffer has every lane)
        p_part = part_ptr + (rb * J_MAX * M_PAD + o_m[None, :]) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        tl.store(p_part + (pid - p_lo) * (M_PAD * BLOCK_N), b_y)
        tl.debug_barrier()      # every thread's partial is issued before the program's arrival is counted
        arrived = tl.atomic_add(cnt_ptr + rb, 1, sem="acq_rel", scope="gpu")
        if arrived == n_parts - 1:
            b_sum = tl.zeros_like(b_y)
            for j in range(n_parts):
                # .cg: from L2, where the other SMs' partials are (this SM's L1 is not coherent with them)
                b_sum += tl.load(p_part + j * (M_PAD * BLOCK_N), cache_modifier=".cg")
            tl.store(p_y, b_sum, mask=m_y)
            tl.atomic_xchg(cnt_ptr + rb, 0, sem="relaxed", scope="gpu")


@triton.jit(**backend.varying("n_tiles", "per", "J_MAX"))
def _nvfp4_gemv_sk_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_ym, row_q, row_s, n_tiles, per, J_MAX,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOAD_MODE: tl.constexpr,
    USE_ASM: tl.constexpr = False, X_INLINE: tl.constexpr = False, X_BUILD: tl.constexpr = False, d_ptr=None,
    ONE_DOT: tl.constexpr = False, SCALE_AHEAD: tl.constexpr = 0, X_AHEAD: tl.constexpr = False,
    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    """STREAM_K: `_nvfp4_gemv_kernel`'s loop over a balanced share of the work. The row blocks' K-tiles in one flat
    order (row block major), program p owns tiles [p · per, (p + 1) · per): every program the same number of tiles
    whatever N (in_proj's 290 row blocks on 132 SMs left 3 on some SMs and 2 on most; split-K fixed the count per
    row block, not the share per SM), and one launch: shares that cut a row block meet in `_stream_k_store`."""
    pid = tl.program_id(0)
    total = tl.cdiv(N, BLOCK_N) * n_tiles
    t0 = pid * per
    t1 = tl.minimum(t0 + per, total)
    o_first = (t0 // n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    _pdl_enter(PDL, w_ptr + tl.minimum(o_first, N - 1).to(tl.int64) * (2 * row_q) + (t0 % n_tiles) * (BLOCK_K // 2),
               PREFETCH)
    gs = tl.load(gs_ptr) * (_UNDO_DECODE if LOAD_MODE == 8 else 32768.0)
    for rb in range(t0 // n_tiles, (t1 - 1) // n_tiles + 1):
        lo = tl.maximum(t0 - rb * n_tiles, 0)
        hi = tl.minimum(t1 - rb * n_tiles, n_tiles)
        o_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        b_y = _gemv_rows_quad(x_ptr, w_ptr, s_ptr, K, row_q, row_s, o_n, m_n, lo * BLOCK_K,
                              tl.minimum(hi * BLOCK_K, K), M_PAD, BLOCK_N, BLOCK_K, LOAD_MODE == 8, USE_ASM,
                              X_INLINE, M, stride_xm, X_BUILD, d_ptr, ONE_DOT, SCALE_AHEAD, X_AHEAD, True)
        _stream_k_store(b_y * gs, part_ptr, cnt_ptr, y_ptr, stride_ym, o_n, m_n, M, rb, lo, hi, n_tiles, per, pid,
                        J_MAX, M_PAD, BLOCK_N)


@triton.jit
def _nvfp4_gemm_body(x_ptr, w_ptr, s_ptr, gs, y_ptr, row_scale_ptr, M, N, K, stride_xm, stride_ym,
                     LAYOUT: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, RELU2: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = act(gs · Σ_k x[m, k] W[n, k]) (· row_scale[m]); W as operand A so y.T = W · x.T."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_n = o_n < N
    m_m = o_m < M
    b_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    o_j = tl.arange(0, BLOCK_K // 2)
    for k0 in range(0, K, BLOCK_K):
        a_lo, a_hi = _nvfp4_tile_split(w_ptr, s_ptr, o_n, m_n, k0, K, N, LAYOUT, BLOCK_K)
        k_e = k0 + 2 * o_j
        m_x = m_m[None, :] & (k_e[:, None] < K)
        x_e = tl.load(x_ptr + o_m[None, :] * stride_xm + k_e[:, None], mask=m_x, other=0.0)
        x_o = tl.load(x_ptr + o_m[None, :] * stride_xm + k_e[:, None] + 1, mask=m_x, other=0.0)
        b_acc = tl.dot(a_lo, (x_e.to(tl.float32) * _X_PRESCALE).to(tl.float16), b_acc)
        b_acc = tl.dot(a_hi, (x_o.to(tl.float32) * _X_PRESCALE).to(tl.float16), b_acc)
    b_y = b_acc * (gs * 32768.0)   # 2^7 (tile) · 2^8 (x prescale)
    if RELU2:
        b_y = tl.maximum(b_y, 0.0)
        b_y = b_y * b_y
    if HAS_ROW_SCALE:
        b_y = b_y * tl.load(row_scale_ptr + o_m, mask=m_m, other=0.0)[None, :]
    tl.store(y_ptr + o_m[None, :] * stride_ym + o_n[:, None], b_y, mask=m_n[:, None] & m_m[None, :])


# M is a prompt's length (9-127 rows: below kernels.dense_prefill's DEQUANT_MIN_ROWS a prefill's projections run here):
# not specialized, so that a prompt of a new length class does not stop on a compile in the middle of serving (H200
# session 17: the API's first 126-token turn after a 128-token one took 1.9-2.6 s, the later ones 0.07)
@triton.jit(**backend.varying("M"))
def _nvfp4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    _nvfp4_gemm_body(x_ptr, w_ptr, s_ptr, tl.load(gs_ptr), y_ptr, gs_ptr, M, N, K, stride_xm, stride_ym,
                     0, False, False, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit(**backend.varying("M"))     # as _nvfp4_gemm_kernel's
def _fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """FP8 per-tensor weight [N, K] e4m3 (exact in fp16) as operand A; x.T [K, M] as B."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_n = o_n < N
    m_m = o_m < M
    b_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_w = tl.load(w_ptr + o_n[:, None] * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0)
        b_w = b_w.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.float16)
        b_x = tl.load(x_ptr + o_m[None, :] * stride_xm + o_k[:, None], mask=m_m[None, :] & m_k[:, None], other=0.0)
        b_x = (b_x.to(tl.float32) * _X_PRESCALE).to(tl.float16)
        b_acc += tl.dot(b_w, b_x)
    b_y = b_acc * (tl.load(scale_ptr) * 256.0)
    tl.store(y_ptr + o_m[None, :] * stride_ym + o_n[:, None], b_y, mask=m_n[:, None] & m_m[None, :])


@triton.jit
def _x_columns_kernel(x_ptr, xc_ptr, M, K, stride_xm, BLOCK: tl.constexpr):
    """x [M, K] -> x.T as fp16 [K, 16] (times 2^-8), column m = x row m, zero beyond M: a plain tensor-core B."""
    o_k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    o_c = tl.arange(0, 16)
    m_k = o_k < K
    v = tl.load(x_ptr + o_c[None, :] * stride_xm + o_k[:, None], mask=(o_c[None, :] < M) & m_k[:, None], other=0.0)
    tl.store(xc_ptr + o_k[:, None] * 16 + o_c[None, :], (v.to(tl.float32) * _X_PRESCALE).to(tl.float16),
             mask=m_k[:, None])


@triton.jit
def _fp8_rows(xc_ptr, w_ptr, o_n, m_n, k_lo, k_hi, M, K, stride_xm, d_ptr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, DIRECT: tl.constexpr, X_BUILD: tl.constexpr, ONE_ROW: tl.constexpr):
    """Σ over k in [k_lo, k_hi) of W[o_n, k] · B[k, :] for `_fp8_gemv_kernel` / `_fp8_gemv_sk_kernel`: fp32
    [BLOCK_N, 16] times 2^-8 (x's prescale)."""
    o_c = tl.arange(0, 16)
    b_acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    if X_BUILD and ONE_ROW:
        d_col = tl.load(d_ptr + tl.arange(0, BLOCK_K)[:, None] * 16 + o_c[None, :])
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_w = tl.load(w_ptr + o_n[:, None] * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0)
        b_w = b_w.to(tl.float8e4nv, bitcast=True)
        if DIRECT:
            b_w = b_w.to(tl.float16)
        else:
            b_w = b_w.to(tl.float32).to(tl.float16)
        if X_BUILD and ONE_ROW:
            b_x = tl.load(xc_ptr + o_k, mask=m_k, other=0.0)
            b_x = (b_x.to(tl.float32) * _X_PRESCALE).to(tl.float16)[:, None] * d_col
        elif X_BUILD:
            b_x = tl.load(xc_ptr + o_c[None, :] * stride_xm + o_k[:, None], mask=(o_c[None, :] < M) & m_k[:, None],
                          other=0.0)
            b_x = (b_x.to(tl.float32) * _X_PRESCALE).to(tl.float16)
        else:
            b_x = tl.load(xc_ptr + o_k[:, None] * 16 + o_c[None, :], mask=m_k[:, None], other=0.0)
        b_acc = tl.dot(b_w, b_x, b_acc)
    return b_acc


@triton.jit
def _fp8_gemv_kernel(xc_ptr, w_ptr, scale_ptr, y_ptr, M, N, K, stride_ym, SPLIT_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr,
                     X_BUILD: tl.constexpr = False, ONE_ROW: tl.constexpr = False, stride_xm=0, d_ptr=None,
                     part_ptr=None, cnt_ptr=None, SPLIT_REDUCE: tl.constexpr = 0, PDL: tl.constexpr = False,
                     PREFETCH: tl.constexpr = False):
    """FP8 per-tensor weight [N, K] (e4m3, exact in fp16) as operand A; B = x.T prepared by _x_columns_kernel
    (loaded whole: no masked gather). DIRECT: e4m3 -> fp16 in one conversion (the interpreter goes via fp32).
    X_BUILD: xc_ptr is x [M, K] itself and B is built per tile: with ONE_ROW (M = 1) x times the column-0 pattern
    at d_ptr (the NVFP4 GEMV's `_b_built` layout argument), else a gather of the M columns. SPLIT_REDUCE 1: as
    `_nvfp4_gemv_kernel`'s (the last split to arrive stores y), with SPLIT_K the true count."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_c = tl.arange(0, 16)
    m_n = o_n < N
    n_split = SPLIT_K     # a constexpr here: taken from the grid it costs 0.5 instructions per weight (SASS)
    k_per_split = tl.cdiv(K, n_split * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    _pdl_enter(PDL, w_ptr + tl.minimum(o_n, N - 1).to(tl.int64) * K + k_lo, PREFETCH)
    b_acc = _fp8_rows(xc_ptr, w_ptr, o_n, m_n, k_lo, k_hi, M, K, stride_xm, d_ptr, BLOCK_N, BLOCK_K, DIRECT, X_BUILD,
                      ONE_ROW)
    b_y = b_acc * (tl.load(scale_ptr) * 256.0)
    p_y = y_ptr + o_c[None, :] * stride_ym + o_n[:, None]
    m_y = m_n[:, None] & (o_c[None, :] < M)
    if SPLIT_K == 1:
        tl.store(p_y, b_y, mask=m_y)
    elif SPLIT_REDUCE == 0:
        tl.atomic_add(p_y, b_y, mask=m_y, sem="relaxed")
    else:
        _split_reduce_last(b_y, part_ptr, cnt_ptr, p_y, m_y, o_n, o_c, pid_n, pid_k, M, N, n_split)


@triton.jit(**backend.varying("n_tiles", "per", "J_MAX"))
def _fp8_gemv_sk_kernel(xc_ptr, w_ptr, scale_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_ym, n_tiles, per, J_MAX,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr,
                        X_BUILD: tl.constexpr = False, ONE_ROW: tl.constexpr = False, stride_xm=0, d_ptr=None,
                        PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """STREAM_K for the FP8 GEMV: `_nvfp4_gemv_sk_kernel`'s balanced shares over `_fp8_rows`."""
    pid = tl.program_id(0)
    total = tl.cdiv(N, BLOCK_N) * n_tiles
    t0 = pid * per
    t1 = tl.minimum(t0 + per, total)
    o_first = (t0 // n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    _pdl_enter(PDL, w_ptr + tl.minimum(o_first, N - 1).to(tl.int64) * K + (t0 % n_tiles) * BLOCK_K, PREFETCH)
    sc = tl.load(scale_ptr) * 256.0
    for rb in range(t0 // n_tiles, (t1 - 1) // n_tiles + 1):
        lo = tl.maximum(t0 - rb * n_tiles, 0)
        hi = tl.minimum(t1 - rb * n_tiles, n_tiles)
        o_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        b_acc = _fp8_rows(xc_ptr, w_ptr, o_n, m_n, lo * BLOCK_K, tl.minimum(hi * BLOCK_K, K), M, K, stride_xm, d_ptr,
                          BLOCK_N, BLOCK_K, DIRECT, X_BUILD, ONE_ROW)
        _stream_k_store(b_acc * sc, part_ptr, cnt_ptr, y_ptr, stride_ym, o_n, m_n, M, rb, lo, hi, n_tiles, per, pid,
                        J_MAX, 16, BLOCK_N)


# ----------------------------------------------------------------------------------------------------
# wrappers

DECODE_MAX_ROWS = 8
DECODE_MODES = (8, 9)
_n_sm_cache: dict = {}


def _n_sm(device) -> int:
    if device.type != "cuda":
        return 4
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _n_sm_cache:
        _n_sm_cache[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _n_sm_cache[i]


def gemv_config(M: int, N: int, K: int, device, n_sm: int | None = None) -> dict:
    """Decode-kernel configuration for M rows of x: the winners of bench/NOTES.md experiment 4 (H200, run 2).
    n_sm: the SM count to plan for (default: the device's; the benchmark's counts name the H200's 132)."""
    m_pad = triton.next_power_of_2(max(M, 1))
    n_sm = n_sm or _n_sm(device)
    # M = 1: mode 8 at BLOCK_N 64 won every shape (in_proj 24.8 us vs 28.8 at BLOCK_N 128, 58.4 for mode 3);
    # M = 2: mode 8 BLOCK_N 128 (28.7 vs 30.5 for mode 9); M = 3-4: mode 9 BLOCK_N 128 (mode 8's K-tile of 64 at
    # M = 4: 43 us); M = 5-8: mode 9, BLOCK_N 64 with prepared x for the large in_proj (25.4 vs 32.6), BLOCK_N 128
    # gathering x in the kernel for the others (out_proj 17.8 vs 19.2: the second launch costs more than the gather)
    if m_pad == 1:
        cfg = dict(LOAD_MODE=8, BLOCK_N=64)
    elif m_pad == 2:
        cfg = dict(LOAD_MODE=8, BLOCK_N=128)
    elif m_pad == 4:
        cfg = dict(LOAD_MODE=9, BLOCK_N=128)
    elif N >= 16384:
        cfg = dict(LOAD_MODE=9, BLOCK_N=64)
    else:
        cfg = dict(LOAD_MODE=9, BLOCK_N=128, X_INLINE=True)
    block_k = 256 // m_pad if cfg["LOAD_MODE"] == 8 else 256
    # short N is better split along K than cut into thinner row blocks (experiment 1); the rule as measured
    split_k = split_k_for(N, K, cfg["BLOCK_N"], 256, n_sm)
    cfg = dict(M_PAD=m_pad, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=3, n_sm=n_sm, **cfg)
    choice = GEMV_CHOICES.get((_arch(device), m_pad, N, K)) if _CHOICES_ON else None
    if choice:
        cfg.update(choice)
        if not _FMA_ON:
            cfg.pop("FMA", None)
        if "SPLIT_K" not in choice and "BLOCK_N" in choice:
            cfg["SPLIT_K"] = split_k_for(N, K, cfg["BLOCK_N"], 256, n_sm)
    return cfg


# Per-shape choices over the rule above, (compute capability as 10 x major + minor, M_PAD, N, K) -> config keys, e.g.
# {(90, 1, 4096, 8192): dict(X_BUILD=True, SPLIT_REDUCE=1, SPLIT_K=8)}: bench.kernels.gemv_nvfp4_sweep's measured
# winners (it prints the dict). Keyed by the GPU because they differ: X_BUILD costs nothing per weight on sm_90
# (wgmma reads B from shared memory) and ~1 instruction per weight on sm_120 (mma.sync, B in every warp's
# registers; SASS counts in bench/NOTES.md). A shape not listed runs experiment 4's rule. The sm_90 entries are the
# H200 sweep of session 5 (bench/results/gemv_sweep_h200_session5.*: every variant checked against the twin at full
# size before and after timing; per 88-layer token at M = 1, 3.77 -> 3.10 ms of GEMV).
GEMV_CHOICES: dict[tuple[int, int, int, int], dict] = {
    # 'FMA': session 13 (h-fmaroute) routes M = 1 to kernels.gemv_nvfp4_fma with the best variant the H200 measured
    # (session 12 call 4, bench/results/gemv_fma_session12_call4.*; µs tensor cores -> FMA); the entry's other keys
    # stay the tensor-core choice that MOESTREAM_GEMV_FMA=0 (or a caller's config without 'FMA') runs
    (90, 1, 18560, 4096): {'SPLIT_K': 2, 'SPLIT_REDUCE': 1, 'FMA': dict(C=4, R=1, PPS=3)},  # in_proj 23.5 -> 19.5
    (90, 1, 4096, 8192): {'SPLIT_K': 8, 'SPLIT_REDUCE': 1, 'FMA': dict(C=4, R=2, PPS=2)},  # out_proj 13.5 -> 13.0
    (90, 1, 4096, 4096): {'SPLIT_K': 8, 'X_BUILD': True, 'SPLIT_REDUCE': 1,
                          'FMA': dict(C=4, R=2, PPS=2)},                                          # attn.q/o 9.3 -> 8.0
    (90, 8, 4096, 4096): {'SPLIT_K': 8, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 1},
    (90, 1, 256, 4096): {'SPLIT_K': 16, 'num_warps': 2, 'BLOCK_N': 32, 'X_BUILD': True, 'SPLIT_REDUCE': 1},
    (90, 8, 256, 4096): {'SPLIT_K': 16, 'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 1},
    (90, 1, 5376, 4096): {'SPLIT_K': 8, 'BLOCK_N': 128, 'X_BUILD': True, 'SPLIT_REDUCE': 1,
                          'FMA': dict(C=4, R=1, PPS=3)},                                        # shared.up 10.7 -> 10.3
    (90, 8, 5376, 4096): {'SPLIT_K': 6, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 1},
    (90, 1, 4096, 5376): {'SPLIT_K': 11, 'BLOCK_N': 128, 'X_BUILD': True, 'SPLIT_REDUCE': 1,
                          'FMA': dict(C=4, R=2, PPS=2)},                       # shared.down 11.2 -> 11.1 (a tie)
    (90, 1, 1024, 4096): {'SPLIT_K': 16, 'num_warps': 2, 'BLOCK_N': 32, 'X_BUILD': True, 'SPLIT_REDUCE': 1},
    (90, 8, 1024, 4096): {'SPLIT_K': 16, 'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 1},
    (90, 1, 4096, 1024): {'SPLIT_K': 4, 'num_warps': 2, 'BLOCK_N': 32, 'X_BUILD': True, 'SPLIT_REDUCE': 1},
    (90, 8, 4096, 1024): {'SPLIT_K': 4, 'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 1},
    (90, 1, 131072, 4096): {'SPLIT_REDUCE': 1, 'FMA': dict(C=4, R=2, PPS=2)},                   # lm_head 103.2 -> 89.3
    # session 7 (h27, bench/results/gemv_streamk_h200_session7_run1.*): STREAM_K where it beat the entry above by
    # >= 3 %, µs today -> STREAM_K at the measured M (2, 4, 8); M = 1 had no such win
    # lm_head: 146.0 -> 113.7 us
    (90, 2, 131072, 4096): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 4, 'LOAD_MODE': 9,
                            'BLOCK_K': 256},
    # mamba.in_proj: 29.5 -> 25.1 us
    (90, 2, 18560, 4096): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 4},
    # mamba.out_proj: 15.9 -> 14.6 us
    (90, 2, 4096, 8192): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 4},
    (90, 2, 5376, 4096): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 3},  # shared.up 15.4 -> 11.9
    # shared.down: 15.2 -> 12.1 us
    (90, 2, 4096, 5376): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 4},
    (90, 2, 4096, 4096): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 6},  # attn.q/o 13.6 -> 10.3
    # fc1_latent: 12.8 -> 6.6 us
    (90, 2, 1024, 4096): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 4, 'LOAD_MODE': 9,
                          'BLOCK_K': 256},
    (90, 2, 4096, 1024): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 3},  # fc2_latent 9.4 -> 5.8
    (90, 2, 256, 4096): {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 4},  # attn.k/v 11.8 -> 5.6
    # lm_head: 133.5 -> 115.9 us
    (90, 4, 131072, 4096): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 8},
    # mamba.in_proj: 32.3 -> 24.8 us
    (90, 4, 18560, 4096): {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 4},
    # mamba.out_proj: 18.4 -> 14.2 us
    (90, 4, 4096, 8192): {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 2},
    (90, 4, 5376, 4096): {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 2},  # shared.up 17.9 -> 13.6
    # shared.down: 19.0 -> 12.5 us
    (90, 4, 4096, 5376): {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 4},
    (90, 4, 4096, 4096): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 2},  # attn.q/o 16.4 -> 10.1
    (90, 4, 1024, 4096): {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 2},  # fc1_latent 15.4 -> 6.6
    (90, 4, 4096, 1024): {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 4},  # fc2_latent 12.1 -> 5.8
    (90, 4, 256, 4096): {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'STREAM_K': 4},  # attn.k/v 14.5 -> 5.2
    # mamba.out_proj: 16.3 -> 14.3 us
    (90, 8, 4096, 8192): {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 2},
    # shared.down: 13.3 -> 12.8 us
    (90, 8, 4096, 5376): {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'STREAM_K': 4},
}
# MOESTREAM_GEMV_CHOICES=0 in the environment at start: experiment 4's rule everywhere (the A/B of bench/NOTES.md,
# session 5); read once, not per call
_CHOICES_ON = os.environ.get("MOESTREAM_GEMV_CHOICES") != "0"


def _fma_on(environ=os.environ) -> bool:
    """MOESTREAM_GEMV_FMA=0: GEMV_CHOICES' and FP8_GEMV_CHOICES' 'FMA' keys ignored, each such shape runs its entry's
    tensor-core choice (the A/B of the FMA routes alone; MOESTREAM_GEMV_CHOICES=0 turns off every entry, the FMA ones
    with them)."""
    return environ.get("MOESTREAM_GEMV_FMA") != "0"


_FMA_ON = _fma_on()     # read once at import, as _CHOICES_ON
_arch_cache: dict = {}


def _arch(device) -> int:
    """10 x major + minor of the device's compute capability (0 off CUDA: the interpreter)."""
    if device.type != "cuda":
        return 0
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _arch_cache:
        major, minor = torch.cuda.get_device_capability(i)
        _arch_cache[i] = 10 * major + minor
    return _arch_cache[i]


def split_k_for(N: int, K: int, block_n: int, block_k: int, n_sm: int, programs_per_sm: int = 2,
                min_tiles: int = 4, even: bool = False) -> int:
    """Splits of K so that about programs_per_sm x n_sm programs run, each over >= min_tiles K-tiles. The defaults
    are experiment 4's rule (zero-fill and atomics made a split of fewer than 4 tiles not worth it); with
    SPLIT_REDUCE 1 a split costs no launch, and min_tiles 1 lets the 1,024-row latent projection fill the SMs.
    even: the fewest splits with the same tiles per split, so that no split is left without a tile."""
    n_blocks = triton.cdiv(N, block_n)
    if n_blocks >= programs_per_sm * n_sm:
        return 1
    split = max(1, min(triton.cdiv(programs_per_sm * n_sm, n_blocks), K // (min_tiles * block_k)))
    if even:
        tiles = triton.cdiv(K, block_k)
        split = triton.cdiv(tiles, triton.cdiv(tiles, split))
    return split


def stream_k_shares(total_tiles: int, programs: int) -> tuple[int, int]:
    """(programs, tiles per program) for STREAM_K: about `programs` equal shares of the flat tile order, none empty."""
    per = max(1, triton.cdiv(total_tiles, max(1, programs)))
    return triton.cdiv(total_tiles, per), per


def _pdl_options(cfg: dict) -> dict:
    """PDL / PREFETCH as launch options: launch_pdl on CUDA; off under the interpreter (no inline PTX there)."""
    if not cfg.get("PDL"):
        cfg.pop("PREFETCH", None)
        cfg.pop("PDL", None)
        return cfg
    if backend.interpreted():
        cfg.update(PDL=False, PREFETCH=False)
    else:
        cfg["launch_pdl"] = True
    return cfg


def x_operands(x2: torch.Tensor, m_pad: int, scale_after: bool, pdl: bool = False) -> torch.Tensor:
    """The B operands of LOAD_MODE 8/9 for x2 [M, K]: fp16 [4, K/4, 16] (see `_x_operands_kernel`)."""
    M, K = x2.shape
    xb = torch.empty((4, K // 4, 16), dtype=torch.float16, device=x2.device)
    block = 128
    _x_operands_kernel[(triton.cdiv(K // 4, block),)](x2, xb, M, K, x2.stride(0), M_PAD=m_pad, SCALE_AFTER=scale_after,
                                                      BLOCK=block, num_warps=4, **_pdl_options(dict(PDL=pdl)))
    return xb


def x_columns(x2: torch.Tensor) -> torch.Tensor:
    """x2 [M <= 16, K] -> fp16 [K, 16], x.T times 2^-8 and zero-padded (`_x_columns_kernel`)."""
    M, K = x2.shape
    xc = torch.empty((K, 16), dtype=torch.float16, device=x2.device)
    block = 256
    _x_columns_kernel[(triton.cdiv(K, block),)](x2, xc, M, K, x2.stride(0), BLOCK=block, num_warps=4)
    return xc


# FP8's per-shape choices, keyed as GEMV_CHOICES (M = the x rows padded to a power of two); a shape not listed runs
# experiment 4's configuration. 'FMA' (session 36): M = 1 runs kernels.gemv_fp8_fma with these fp8_fma_config keys
# (the CUDA cores; the H100's sweep, bench/results/fp8fma_session36_call*: µs tensor cores -> FMA); the entry's other
# keys stay the tensor-core choice that MOESTREAM_GEMV_FMA=0 (or a caller's config without 'FMA') runs
FP8_GEMV_CHOICES: dict[tuple[int, int, int, int], dict] = {
    # session 7 (h27, bench/results/gemv_streamk_h200_session7_run1.*): µs experiment 4's config -> STREAM_K
    (90, 1, 18560, 4096): {'STREAM_K': 4, 'num_stages': 3,
                           'FMA': dict(C=8, R=1, PPS=2)},                               # mamba.in_proj 40.0 -> 28.4
    (90, 1, 4096, 8192): {'STREAM_K': 2, 'FMA': dict(C=8, R=2, PPS=2)},               # mamba.out_proj 18.2 -> 16.8
    (90, 1, 5376, 4096): {'STREAM_K': 3, 'FMA': dict(C=8, R=1, PPS=2)},               # shared.up 15.1 -> 10.9
    (90, 1, 4096, 5376): {'STREAM_K': 3, 'FMA': dict(C=8, R=2, PPS=2)},               # shared.down 14.2 -> 13.3
    (90, 1, 1024, 4096): {'STREAM_K': 1, 'X_BUILD': True, 'FMA': dict(C=8, R=1, PPS=2)},   # fc1_latent 7.3 -> 4.9
    (90, 8, 18560, 4096): {'STREAM_K': 3, 'X_BUILD': True},  # mamba.in_proj 31.6 -> 27.7
    (90, 8, 4096, 8192): {'STREAM_K': 2, 'X_BUILD': True},  # mamba.out_proj 18.3 -> 14.9
    (90, 8, 5376, 4096): {'STREAM_K': 3, 'X_BUILD': True},  # shared.up 14.2 -> 12.9
    (90, 8, 4096, 5376): {'STREAM_K': 3, 'X_BUILD': True},  # shared.down 14.7 -> 11.7
    (90, 8, 1024, 4096): {'STREAM_K': 1, 'X_BUILD': True},  # fc1_latent 8.9 -> 6.4
}


def fp8_gemv_config(N: int, K: int, device, config: dict | None = None, n_sm: int | None = None,
                    M: int | None = None) -> dict:
    """`_fp8_gemv_kernel`'s configuration: BLOCK_N 64, BLOCK_K 128 (experiment 4), FP8_GEMV_CHOICES' entry for
    (M, N, K) when M is given, then `config`; split-K by the NVFP4 rule unless one of them fixes it."""
    base = dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=4)
    choice = (FP8_GEMV_CHOICES.get((_arch(device), triton.next_power_of_2(max(M, 1)), N, K))
              if M is not None and _CHOICES_ON else None) or {}
    cfg = {**base, **choice, **(config or {})}
    if not _FMA_ON:
        cfg.pop("FMA", None)
    n_sm = n_sm or _n_sm(device)
    n_blocks = triton.cdiv(N, cfg["BLOCK_N"])
    if "SPLIT_K" not in {**choice, **(config or {})} and n_blocks < 2 * n_sm:
        cfg["SPLIT_K"] = max(1, min(triton.cdiv(2 * n_sm, n_blocks), K // (4 * cfg["BLOCK_K"])))
    return cfg


def fp8_gemv(x2: torch.Tensor, weight_e4m3: torch.Tensor, scale, out_dtype, config: dict | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-shape FP8 linear (M <= 16 rows of x): y [M, N] through `_fp8_gemv_kernel`. Config keys beside the
    tile sizes: X_BUILD, SPLIT_REDUCE (as nvfp4_linear's; off by default until measured). FMA (a dict of
    kernels.gemv_fp8_fma.fp8_fma_config keys, FP8_GEMV_CHOICES' M = 1 entries on sm_90): the call runs
    `fp8_linear_fma` instead (the CUDA cores), by nvfp4_linear's rule: a caller's `config` decides alone, and the FMA
    kernel's preconditions (1-2 rows, K a multiple of 16, 16-byte aligned codes) failing, the tensor-core keys run."""
    N, K = weight_e4m3.shape
    M = x2.shape[0]
    cfg = fp8_gemv_config(N, K, x2.device, config, M=M)
    fma = cfg.pop("FMA", None)
    if config and "FMA" not in config:
        fma = None          # a caller's config decides alone
    if fma is not None and M <= 2 and K % 16 == 0 and weight_e4m3.data_ptr() % 16 == 0:
        from kernels import gemv_fp8_fma     # (it imports kernels.gemv_nvfp4_fma, which imports this module)
        return gemv_fp8_fma.fp8_linear_fma(x2, weight_e4m3, scale, out_dtype=out_dtype, config=fma, out=out)
    cfg = _pdl_options(cfg)
    n_blocks = triton.cdiv(N, cfg["BLOCK_N"])
    stream_k = cfg.pop("STREAM_K", 0)
    if stream_k:
        cfg.pop("SPLIT_REDUCE", None)
        cfg["SPLIT_K"] = 1
    reduce_last = cfg["SPLIT_K"] > 1 and cfg.get("SPLIT_REDUCE", 0) == 1
    if cfg["SPLIT_K"] > 1 and not reduce_last:
        y = torch.zeros((M, N), dtype=torch.float32, device=x2.device)
    else:
        y = out if out is not None else torch.empty((M, N), dtype=out_dtype, device=x2.device)
    grid = (n_blocks, cfg["SPLIT_K"])
    if cfg.get("X_BUILD", False):    # B from x in the kernel: no x launch (see _fp8_gemv_kernel)
        xa = x2
        cfg.update(stride_xm=x2.stride(0), ONE_ROW=M == 1)
        if M == 1:                   # column 0 of every row: the NVFP4 pattern at M_PAD 1, plain B
            cfg["d_ptr"] = x_pattern(x2.device, 1, False, 4 * cfg["BLOCK_K"])
    else:
        xa = x_columns(x2)
    if stream_k:      # one launch over balanced shares (see _nvfp4_gemv_sk_kernel)
        cfg.pop("SPLIT_K")
        n_tiles = triton.cdiv(K, cfg["BLOCK_K"])
        programs, per = stream_k_shares(n_blocks * n_tiles, stream_k * _n_sm(x2.device))
        j_max = (n_tiles - 1) // per + 2
        part = torch.empty(n_blocks * j_max * 16 * cfg["BLOCK_N"], dtype=torch.float32, device=x2.device)
        _fp8_gemv_sk_kernel[(programs,)](xa, _as_u8(weight_e4m3), _global(scale, x2.device), y, part,
                                         _arrival_counters(x2.device, n_blocks), M, N, K, y.stride(0), n_tiles, per,
                                         j_max, DIRECT=not backend.interpreted(), **cfg)
        return y
    if reduce_last:
        cfg.update(part_ptr=torch.empty((cfg["SPLIT_K"], M, N), dtype=torch.float32, device=x2.device),
                   cnt_ptr=_arrival_counters(x2.device, n_blocks))
    else:
        cfg.pop("SPLIT_REDUCE", None)
    _fp8_gemv_kernel[grid](xa, _as_u8(weight_e4m3), _global(scale, x2.device), y, M, N, K, y.stride(0),
                           DIRECT=not backend.interpreted(), **cfg)
    return y


_patterns: dict = {}


def x_pattern(device, m_pad: int, scale_after: bool, block_k: int) -> torch.Tensor:
    """B's 0/1 pattern for X_BUILD, fp16 [BLOCK_K / 4, 16]: 1 where `_x_operands_kernel` would place an x
    value (column c of row i holds x row c // G, G = 16 / M_PAD; with SCALE_AFTER only if c % G = (i / 4) mod G,
    else only if c % G = 0). Made once per device and layout, on the device (no host copy: a first call inside a
    CUDA-graph capture stays legal); read-only, so any number of streams may share it."""
    key = (device.type, device.index, m_pad, scale_after, block_k)
    if key not in _patterns:
        q = block_k // 4
        g = 16 // m_pad
        i = torch.arange(q, device=device)[:, None]
        c = torch.arange(16, device=device)[None, :]
        on = (c % g == (i // 4) % g) if scale_after else (c % g == 0).expand(q, 16)
        _patterns[key] = on.to(torch.float16).contiguous()
    return _patterns[key]


_arrival_by_stream: dict = {}
_arrival_retired: list = []   # outgrown counter sets: a captured graph may still hold their address


def _arrival_counters(device, n: int) -> torch.Tensor:
    """int32 counters, zero between calls (each call's last arrivals put them back), one set per stream so that
    GEMVs on concurrent streams never share one."""
    index = device.index
    if device.type == "cuda" and index is None:    # "cuda" and "cuda:0" must name one set (a must-fail twin that
        index = torch.cuda.current_device()         # poisoned the other set passed on the H200, session 8)
    stream = torch.cuda.current_stream(index).cuda_stream if device.type == "cuda" else 0
    key = (device.type, index, stream)
    c = _arrival_by_stream.get(key)
    if c is None or c.numel() < n:
        if c is not None:
            _arrival_retired.append(c)
        c = _arrival_by_stream[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def _fma_fits(M: int, K: int, weight_u8: torch.Tensor, weight_scale_e4m3: torch.Tensor) -> bool:
    """The FMA GEMV's preconditions: 1-2 rows of x, whole 16-byte words of codes per row, the words and the scale
    pairs aligned as its LDG.128 / 2-byte loads read them."""
    return (M <= 2 and K % 32 == 0 and weight_u8.data_ptr() % 16 == 0 and weight_scale_e4m3.data_ptr() % 2 == 0)


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def rows_of(x: torch.Tensor, K: int) -> tuple[torch.Size, torch.Tensor]:
    """x [..., K] as (its leading shape, [M, K] rows with unit column stride)."""
    x2 = x.reshape(-1, K)
    return x.shape[:-1], (x2 if x2.stride(-1) == 1 else x2.contiguous())


def _global(g, device) -> torch.Tensor:
    return torch.as_tensor(g, dtype=torch.float32, device=device).reshape(1)


# the tile-decoding GEMM's configuration (rows above DECODE_MAX_ROWS: a prefill's projections of spans below
# kernels.dense_prefill's DEQUANT_MIN_ROWS, and every piece where no decoded copy fits, e.g. the server's 512 MiB)
GEMM_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
GEMM_KEYS = tuple(GEMM_CONFIG)
_gemm_env: dict = {}


def gemm_config_env() -> dict:
    """MOESTREAM_NVFP4_GEMM ("KEY=INT,..." or "KEY=INT:...", keys of GEMM_CONFIG; ":" fits a bench.prefill arm, whose
    list is split at commas): the tile-decoding GEMM's configuration over GEMM_CONFIG, a measuring knob read per call
    (bench.prefill's arms A/B it in one engine); {} when unset. A bad entry raises a ValueError naming the variable."""
    raw = os.environ.get("MOESTREAM_NVFP4_GEMM", "")
    hit = _gemm_env.get(raw)
    if hit is not None:
        return hit
    out = {}
    for part in filter(None, raw.replace(":", ",").split(",")):
        key, _, val = part.partition("=")
        if key not in GEMM_KEYS or not val.isdigit() or int(val) < 1:
            raise ValueError(f"MOESTREAM_NVFP4_GEMM={raw!r}: expected KEY=INT,... with keys {', '.join(GEMM_KEYS)}")
        out[key] = int(val)
    _gemm_env[raw] = out
    return out


def nvfp4_linear(x: torch.Tensor, weight_u8: torch.Tensor, weight_scale_e4m3: torch.Tensor, global_scale,
                 out_dtype=None, config: dict | None = None, out: torch.Tensor | None = None,
                 xb: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T, W an NVFP4 weight (U8 [N, K/2], e4m3 [N, K/16], global fp32). x [..., K]; y [..., N].

    `out`: optional [M, N] buffer the kernel writes (tests poison it); ignored when K is split by atomics.
    `xb`: x's prepared B operands, `x_operands(x2, M_PAD, LOAD_MODE == 8)` for this call's configuration, made
    once for every GEMV that reads the same x (q/k/v; the shared expert's up and the latent fc1): no x launch here.
    Decode config keys beside experiment 4's: X_BUILD (B built in the kernel from x: one launch), SPLIT_REDUCE 1
    (split-K partials reduced by the last split to arrive: no zero-fill, no cast launch), ONE_DOT (mode 8: one dot
    per K-tile). SPLIT_REDUCE's arrival counters are one set per CUDA stream: GEMVs that may run at the same time
    must be issued (or captured) on different streams.
    FMA (a dict of kernels.gemv_nvfp4_fma.fma_config keys, GEMV_CHOICES' M = 1 entries on sm_90): the call runs
    `nvfp4_linear_fma` instead (HFMA2 on the CUDA cores; its split-K join uses the same per-stream counters, so it is
    as graph-safe as SPLIT_REDUCE). A caller's `config` decides alone: with one, the FMA kernel runs only if it names
    'FMA' (the sweeps' tensor-core variants stay tensor-core variants). `xb` is not read by the FMA kernel (it loads x
    itself). The FMA kernel's preconditions (1-2 rows, K a multiple of 32, 16-byte aligned codes) failing, the
    entry's tensor-core keys run.
    """
    N, K = weight_u8.shape[0], weight_u8.shape[1] * 2
    assert x.shape[-1] == K and weight_scale_e4m3.shape == (N, K // 16), (x.shape, weight_scale_e4m3.shape)
    assert weight_u8.is_contiguous() and weight_scale_e4m3.is_contiguous()
    lead, x2 = rows_of(x, K)
    M = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    gs = _global(global_scale, x.device)
    s_u8 = _as_u8(weight_scale_e4m3)
    if M <= DECODE_MAX_ROWS:
        cfg = {**gemv_config(M, N, K, x.device), **(config or {})}
        cfg.pop("n_sm", None)
        fma = cfg.pop("FMA", None)
        if config and "FMA" not in config:
            fma = None      # a caller's config decides alone
        if fma is not None and _fma_fits(M, K, weight_u8, weight_scale_e4m3):
            return _fma.nvfp4_linear_fma(x, weight_u8, weight_scale_e4m3, gs, out_dtype=out_dtype, config=fma,
                                         out=out)
        if cfg["LOAD_MODE"] not in DECODE_MODES:
            raise ValueError(f"LOAD_MODE {cfg['LOAD_MODE']}: kernels/ keeps modes {DECODE_MODES} (the others: bench/kernels)")
        cfg.setdefault("USE_ASM", not backend.interpreted())
        _pdl_options(cfg)
        if cfg["LOAD_MODE"] == 8:   # block-diagonal B_J: 16 columns = M_PAD rows x the tile's 16-groups
            if "BLOCK_K" in (config or {}) and config["BLOCK_K"] != 256 // cfg["M_PAD"]:
                raise ValueError(f"LOAD_MODE 8 at M_PAD {cfg['M_PAD']} needs BLOCK_K {256 // cfg['M_PAD']}")
            if cfg["M_PAD"] > 4:
                raise ValueError("LOAD_MODE 8 takes up to 4 rows of x (its B would need K-tiles of 8)")
            cfg["BLOCK_K"] = 256 // cfg["M_PAD"]
        split = cfg["SPLIT_K"]
        stream_k = cfg.pop("STREAM_K", 0)
        reduce_last = split > 1 and cfg.get("SPLIT_REDUCE", 0) == 1
        if split > 1 and not reduce_last and not stream_k:
            y = torch.zeros((M, N), dtype=torch.float32, device=x.device)
        else:  # the kernel stores in the output dtype: no extra cast launch
            y = out if out is not None else torch.empty((M, N), dtype=out_dtype, device=x.device)
        n_blocks = triton.cdiv(N, cfg["BLOCK_N"])
        grid = (n_blocks, split)
        x_in_kernel = cfg.get("X_INLINE", False) or cfg.get("X_BUILD", False)
        if x_in_kernel and xb is not None:
            raise ValueError("xb (prepared x operands) given to a configuration that reads x itself (X_INLINE/X_BUILD)")
        xa = x2
        if not x_in_kernel:
            if xb is None:
                xa = x_operands(x2, cfg["M_PAD"], cfg["LOAD_MODE"] == 8, pdl=cfg.get("PDL", False))
            elif xb.shape != (4, K // 4, 16) or xb.dtype != torch.float16:
                raise ValueError(f"xb: prepared x operands must be fp16 (4, {K // 4}, 16), got {xb.dtype} "
                                 f"{tuple(xb.shape)}")
            else:
                xa = xb
        if cfg.get("X_AHEAD", False) and (not cfg.get("X_BUILD", False) or cfg.get("ONE_DOT", False)):
            raise ValueError("X_AHEAD loads X_BUILD's x values ahead; it needs X_BUILD and no ONE_DOT")
        if cfg.get("ONE_DOT", False) and cfg["LOAD_MODE"] != 8:
            raise ValueError("ONE_DOT joins LOAD_MODE 8's four J tiles; mode 9 has no such path")
        if cfg.get("X_BUILD", False):
            cfg["d_ptr"] = x_pattern(x.device, cfg["M_PAD"], cfg["LOAD_MODE"] == 8, cfg["BLOCK_K"])
        if stream_k:      # one launch over balanced shares (see _nvfp4_gemv_sk_kernel); no split-K keys
            for key in ("SPLIT_K", "SPLIT_REDUCE"):
                cfg.pop(key, None)
            n_tiles = triton.cdiv(K, cfg["BLOCK_K"])
            programs, per = stream_k_shares(n_blocks * n_tiles, stream_k * _n_sm(x.device))
            j_max = (n_tiles - 1) // per + 2
            part = torch.empty(n_blocks * j_max * cfg["M_PAD"] * cfg["BLOCK_N"], dtype=torch.float32, device=x.device)
            _nvfp4_gemv_sk_kernel[(programs,)](xa, weight_u8, s_u8, gs, y, part, _arrival_counters(x.device, n_blocks),
                                               M, N, K, x2.stride(0), y.stride(0), K // 4, K // 16, n_tiles, per,
                                               j_max, **cfg)
            return (y if y.dtype == out_dtype else y.to(out_dtype)).reshape(*lead, N)
        if reduce_last:   # no zero-fill: partials are written before they are read, counters left at zero
            cfg["part_ptr"] = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
            cfg["cnt_ptr"] = _arrival_counters(x.device, n_blocks)
            cfg["SPLIT_K"] = 2      # the kernel counts the splits from the grid: one compilation for all counts
        else:
            cfg.pop("SPLIT_REDUCE", None)
        _nvfp4_gemv_kernel[grid](xa, weight_u8, s_u8, gs, y, M, N, K, x2.stride(0), y.stride(0), K // 4, K // 16,
                                 **cfg)
    else:
        cfg = {**GEMM_CONFIG, **gemm_config_env(), **(config or {})}
        # stored in the output dtype by the kernel (the fp32 accumulator rounded once, as a cast would): no cast launch
        y = out if out is not None else torch.empty((M, N), dtype=out_dtype, device=x.device)
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
        _nvfp4_gemm_kernel[grid](x2, weight_u8, s_u8, gs, y, M, N, K, x2.stride(0), y.stride(0), **cfg)
    return (y if y.dtype == out_dtype else y.to(out_dtype)).reshape(*lead, N)


def fp8_linear(x: torch.Tensor, weight_e4m3: torch.Tensor, scale, out_dtype=None,
               config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T, W a per-tensor FP8 weight (e4m3 [N, K], fp32 scale). x [..., K]; y [..., N]."""
    N, K = weight_e4m3.shape
    assert x.shape[-1] == K and weight_e4m3.is_contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M <= DECODE_MAX_ROWS and "BLOCK_M" not in (config or {}):
        y = fp8_gemv(x2, weight_e4m3, scale, out_dtype or x.dtype, config=config, out=out)
        return (y if y.dtype == (out_dtype or x.dtype) else y.to(out_dtype or x.dtype)).reshape(*lead, N)
    block_m = 16 if M <= 16 else 64
    n_sm = _n_sm(x.device)
    block_n = 128
    while block_n > 16 and triton.cdiv(N, block_n) * triton.cdiv(M, block_m) < 2 * n_sm:
        block_n //= 2
    cfg = {**dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=4, num_stages=3), **(config or {})}
    y = out if out is not None else torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)   # no cast launch
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
    _fp8_gemm_kernel[grid](x2, _as_u8(weight_e4m3), _global(scale, x.device), y, M, N, K,
                           x2.stride(0), y.stride(0), **cfg)
    return y.to(out_dtype or x.dtype).reshape(*lead, N)


# ----------------------------------------------------------------------------------------------------
# plain-PyTorch twins (the reference in tests, the CPU backend)

def nvfp4_linear_torch(x, weight_u8, weight_scale_e4m3, global_scale, out_dtype=None):
    w = decode_nvfp4(weight_u8, weight_scale_e4m3, global_scale)
    return (x.float() @ w.t()).to(out_dtype or x.dtype)


def fp8_linear_torch(x, weight_e4m3, scale, out_dtype=None):
    return (x.float() @ decode_fp8(weight_e4m3, scale).t()).to(out_dtype or x.dtype)


# the FMA GEMV imports this module's counters and helpers: imported last, once they exist
from kernels import gemv_nvfp4_fma as _fma  # noqa: E402
