"""The NVFP4 decode GEMV without the tensor cores (issue 19, part 1; session 12, h-gemv): HFMA2 on the CUDA cores,
x held in registers for a whole K-slice, one launch, a deterministic split-K join.

    y[m, n] = gs * sum_g scale[n, g] * sum_{k in g} e2m1[n, k] * x[m, k]

Where it runs (session 13, h-fmaroute): `kernels.gemv_nvfp4.nvfp4_linear` calls `nvfp4_linear_fma` when the shape's
`GEMV_CHOICES` entry carries an 'FMA' key (the config below): on sm_90 at M = 1 for in_proj 18,560 x 4,096,
out_proj 4,096 x 8,192, q/o 4,096 x 4,096, shared up 5,376 x 4,096 / down 4,096 x 5,376 and the lm_head 131,072 x
4,096, where the H200 measured it faster than the tensor-core GEMV (session 12 call 4,
bench/results/gemv_fma_session12_call4.*: 4-17 %). It lost at M = 2 (issue-bound: ~2 instructions a weight-row)
and on the latent fc1 / fc2 (1,024 x 4,096, 4,096 x 1,024: launch and first tile dominate), so those stay on the
tensor cores. MOESTREAM_GEMV_FMA=0 turns only these entries off (the tensor-core choice of the same entry runs).
The experiments around it (SASS counts per variant, the sweep, the read probe's use) are in
bench/kernels/gemv_nvfp4_fma.py and bench/kernels/gemv_fma_sweep.py.

Layout of the work. A program owns one K-slice j (grid axis 1) of at most C x 1,024 codes and a contiguous run of
`rows_per_prog` rows (grid axis 0). Lane l of every warp owns the 16-byte chunks c * 512 + l * 16 of the slice
(32 codes = two 16-groups each, C chunks, coalesced 512 bytes per warp and chunk); the warps take R rows each per
iteration. So a lane's K positions never change: its x values are loaded, scaled and converted to fp16 pairs once per
program (16 registers per chunk and x row) and reused for every row the program reads, and per row and chunk a
lane loads one 16-byte word of codes (LDG.128) and one 2-byte pair of e4m3 scales. The lanes' partial sums of a row
meet in one warp reduction per row (~13 instructions per row against ~270 of decode at C = 4). Slices > 1: each
program stores fp32 partials and the last of a row run's S programs to arrive (acq_rel counter from
kernels.gemv_nvfp4's per-stream set, the one the tensor-core SPLIT_REDUCE / STREAM_K paths use) sums them in slice
order and stores y: no zero-fill, no atomics on y, the same bits on every call. CUDA graphs: the counters are zero
between calls (the last arrival resets its own), so a captured call replays with the state it was captured with;
the fp32 partials are a torch.empty of the call (the graph's pool when captured), written before they are read.

The decode (inline PTX, 11 instructions per 8 codes, counted by bench.kernels.gemv_nvfp4_fma --sass): the e2m1 code
s.e1e0m becomes the fp16 high byte s000e1e0m0 (value * 2^-14, subnormals included), built once per 4 codes in a "T"
register whose bytes hold that form — odd nibbles: ((r >> 3) & 0x0E0E0E0E) | (r & 0x80808080), even nibbles:
((r << 1) & 0x0E0E0E0E) | ((r << 4) & 0x80808080) — and moved into fp16 pairs by one byte permute per pair (PRMT with a
zero register: lane 0 and 1 of the pair are codes q and q + 4 of the word). Why no cheaper form: a LOP3 takes one
immediate, so it can route two sources into three bit classes (magnitude, sign, zero) only when one source is
already clean; the sign has to move 3 bits further than the magnitude; so every 4 codes cost a shift, a mask and a
merge (odd) or two shifts, a mask and a merge (even), and every pair one instruction to put it in place. The
products: HFMA2 (fp16 pairs, fp16 sums) over one 16-group (8 HFMA2 per x row, two lanes of 8 products each), then
the group's pair scaled by its e4m3 scale in fp16 (cvt.rn.f16x2.e4m3x2: exact) and the two lanes summed in fp32.

Precision (the choice of fp16 math): x is scaled per program and x row by a power of two so that its largest
|value| in the slice lies in [2^10, 2^11) (X_TOP_EXP): every product mag * 2^-14 * x16 <= 0.75, a group's lane <= 6,
scaled by an e4m3 scale <= 448: <= 2,688, a chunk's two groups <= 5,376, a lane's four chunks <= 21,504 < 65,504 (no
overflow for any x), and products stay normal fp16 down to |x| = max|x| * 2^-10. Rounding: fp16 (2^-11) per HFMA2,
~sqrt(8) of them per lane, random across the 256 groups of a row: ~1e-3 relative (1.7e-3 measured at full size on
the H200), under the 5e-3 the engine's bf16 checks allow (bf16 itself rounds at ~1.1e-3). bf16 pairs (HFMA2.BF16)
would need no x scaling but round at 2^-8: ~3e-3 relative; fp32 FFMA costs one instruction per weight.

PROBE=True (bench only): the same grid, layout and loads with no decode (the words summed as integers): the memory
pipeline alone, kept as a flag of this kernel so that the probe and the GEMV cannot drift apart. On a CPU the kernel
runs under Triton's interpreter (TRITON_INTERPRET=1 set before import, as the tests and the sweep do) with the same
arithmetic in plain Triton ops.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.gemv_nvfp4 import _arrival_counters, _as_u8, _global, _n_sm

# one word (8 codes, low nibble first) -> 4 fp16 pairs (codes q, q + 4), q = 0..3, each e2m1 * 2^-14 exactly
DECODE_PTX = ("{.reg .b32 o, e, t, z; mov.b32 z, 0; "
              "shr.u32 t, $4, 3; and.b32 t, t, 0x0E0E0E0E; lop3.b32 o, t, $4, 0x80808080, 0xF8; "
              "shl.b32 t, $4, 1; and.b32 t, t, 0x0E0E0E0E; shl.b32 e, $4, 4; lop3.b32 e, t, e, 0x80808080, 0xF8; "
              "prmt.b32 $0, e, z, 0x2404; prmt.b32 $1, o, z, 0x2404; prmt.b32 $2, e, z, 0x3414; "
              "prmt.b32 $3, o, z, 0x3414;}")
# one 16-group: 8 weight pairs ($1-$8) times 8 x pairs ($9-$16), fp16 sums in two lanes
CHAIN_PTX = ("{mul.rn.f16x2 $0, $1, $9; fma.rn.f16x2 $0, $2, $10, $0; fma.rn.f16x2 $0, $3, $11, $0; "
             "fma.rn.f16x2 $0, $4, $12, $0; fma.rn.f16x2 $0, $5, $13, $0; fma.rn.f16x2 $0, $6, $14, $0; "
             "fma.rn.f16x2 $0, $7, $15, $0; fma.rn.f16x2 $0, $8, $16, $0;}")
# a chunk's two group pairs ($1, $2) times their e4m3 scales (the low two bytes of $3), an fp16 pair
TAIL_PTX = ("{.reg .b16 sl, sh, h0, h1; .reg .b32 s, sb; "
            "mov.b32 {sl, sh}, $3; cvt.rn.f16x2.e4m3x2 s, sl; mov.b32 {h0, h1}, s; "
            "mov.b32 sb, {h0, h0}; mul.rn.f16x2 $0, $1, sb; mov.b32 sb, {h1, h1}; fma.rn.f16x2 $0, $2, sb, $0;}")
# both lanes of an fp16 pair summed in fp32
LANES_PTX = "{.reg .b16 h0, h1; .reg .f32 f0, f1; mov.b32 {h0, h1}, $1; cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; add.f32 $0, f0, f1;}"

DECODE_ASM = tl.constexpr(DECODE_PTX)
CHAIN_ASM = tl.constexpr(CHAIN_PTX)
TAIL_ASM = tl.constexpr(TAIL_PTX)
LANES_ASM = tl.constexpr(LANES_PTX)
# a 2-byte load into a 32-bit register (zero-extended): the scale pairs in the words' layout
LD_U16_ASM = tl.constexpr("ld.global.nc.u16 $0, [$1];")
X_TOP_EXP = tl.constexpr(11)      # max |x| of a slice scaled into [2^(X_TOP_EXP - 1), 2^X_TOP_EXP)
# a combine function cannot take a constexpr flag: the GPU path of `_hadd2` is chosen at import
HADD2_ON_GPU = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


# ---- the decode and the products, as inline PTX on the GPU and as the same arithmetic under the interpreter

@triton.jit
def _decode_word(r, USE_ASM: tl.constexpr):
    """uint32 word (codes 0-7) -> the fp16 pairs (codes q, q + 4) for q = 0..3, as uint32 bit patterns."""
    if USE_ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(DECODE_ASM, "=r,=r,=r,=r,r", [r],
                                                   dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                                   is_pure=True, pack=1)
    else:
        o = ((r >> 3) & 0x0E0E0E0E) | (r & 0x80808080)
        e = ((r << 1) & 0x0E0E0E0E) | ((r << 4) & 0x80808080)
        p0 = ((e & 0xFF) << 8) | ((e & 0xFF0000) << 8)
        p1 = ((o & 0xFF) << 8) | ((o & 0xFF0000) << 8)
        p2 = e & 0xFF00FF00
        p3 = o & 0xFF00FF00
    return p0, p1, p2, p3


@triton.jit
def _lane(p, HI: tl.constexpr):
    """fp16 lane of a uint32 pair as fp32 (interpreter path)."""
    if HI:
        b = p >> 16
    else:
        b = p & 0xFFFF
    return b.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pack(lo, hi):
    """Two fp32 lanes rounded to fp16, as the uint32 pair (interpreter path)."""
    return (lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
            | (hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32) << 16))


@triton.jit
def _fma16(c, w, x):
    """fma.rn.f16x2 on uint32 pairs under the interpreter: the fp32 product of two fp16 is exact, the sum is rounded
    to fp16 (one rounding, as the HFMA2)."""
    return _pack(_lane(c, False) + _lane(w, False) * _lane(x, False), _lane(c, True) + _lane(w, True) * _lane(x, True))


@triton.jit
def _chain(w, x, USE_ASM: tl.constexpr):
    """One 16-group: sum of 8 pair products, fp16 pairs in, an fp16 pair out (uint32 bits)."""
    if USE_ASM:
        c = tl.inline_asm_elementwise(CHAIN_ASM, "=r" + ",r" * 16,
                                      [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7],
                                       x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]],
                                      dtype=tl.uint32, is_pure=True, pack=1)
    else:
        c = _pack(_lane(w[0], False) * _lane(x[0], False), _lane(w[0], True) * _lane(x[0], True))
        for i in tl.static_range(1, 8):
            c = _fma16(c, w[i], x[i])
    return c


@triton.jit
def _tail(c0, c1, s2, USE_ASM: tl.constexpr):
    """Two groups' pairs times their e4m3 scales (bytes 0 and 1 of s2), in fp16: an fp16 pair."""
    if USE_ASM:
        v = tl.inline_asm_elementwise(TAIL_ASM, "=r,r,r,r", [c0, c1, s2], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        s0 = (s2 & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s1 = ((s2 >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v = _pack(_lane(c0, False) * s0, _lane(c0, True) * s0)
        v = _pack(_lane(v, False) + _lane(c1, False) * s1, _lane(v, True) + _lane(c1, True) * s1)
    return v


@triton.jit
def _hadd2(a, b):
    """add.rn.f16x2 (the sum over a lane's chunks), inline PTX on the GPU."""
    if HADD2_ON_GPU:
        v = tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True,
                                      pack=1)
    else:
        v = _pack(_lane(a, False) + _lane(b, False), _lane(a, True) + _lane(b, True))
    return v


@triton.jit
def _lanes_f32(v, USE_ASM: tl.constexpr):
    """Both fp16 lanes of a pair summed in fp32."""
    if USE_ASM:
        f = tl.inline_asm_elementwise(LANES_ASM, "=f,r", [v], dtype=tl.float32, is_pure=True, pack=1)
    else:
        f = _lane(v, False) + _lane(v, True)
    return f


# ---- x: loaded, scaled and paired once per program

@triton.jit
def _x_amax(x_ptr, kc, m_k):
    """max |x| over the 32 codes of each chunk [1, C, 32] (fp32)."""
    a = tl.zeros(kc.shape, dtype=tl.float32)
    for i in tl.static_range(32):
        a = tl.maximum(a, tl.abs(tl.load(x_ptr + kc + i, mask=m_k, other=0.0).to(tl.float32)))
    return a


@triton.jit
def _x_half(x_ptr, kc, m_k, i: tl.constexpr, x_scale):
    v = (tl.load(x_ptr + kc + i, mask=m_k, other=0.0).to(tl.float32) * x_scale).to(tl.float16)
    return v.to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _x_pairs(x_ptr, kc, m_k, x_scale, J: tl.constexpr):
    """The 4 x pairs of word J of each chunk: (x[8J + q], x[8J + q + 4]) * x_scale as fp16, q = 0..3."""
    b = 8 * J
    return (_x_half(x_ptr, kc, m_k, b, x_scale) | (_x_half(x_ptr, kc, m_k, b + 4, x_scale) << 16),
            _x_half(x_ptr, kc, m_k, b + 1, x_scale) | (_x_half(x_ptr, kc, m_k, b + 5, x_scale) << 16),
            _x_half(x_ptr, kc, m_k, b + 2, x_scale) | (_x_half(x_ptr, kc, m_k, b + 6, x_scale) << 16),
            _x_half(x_ptr, kc, m_k, b + 3, x_scale) | (_x_half(x_ptr, kc, m_k, b + 7, x_scale) << 16))


@triton.jit
def _x_row(x_ptr, kc, m_k):
    """(x pairs of the 4 words as one 16-tuple, the power of two x was scaled by) for one x row."""
    amax = tl.max(tl.max(tl.max(_x_amax(x_ptr, kc, m_k), axis=2), axis=1), axis=0)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, tl.full([], X_TOP_EXP - 1, tl.int32)), 254)      # an all-zero slice: any finite scale
    # 2^(X_TOP_EXP + 126 - e): max |x| in [2^(e-127), 2^(e-126)) maps into [2^(X_TOP_EXP-1), 2^X_TOP_EXP)
    x_scale = ((tl.full([], X_TOP_EXP + 253, tl.int32) - e) << 23).to(tl.float32, bitcast=True)
    p0 = _x_pairs(x_ptr, kc, m_k, x_scale, 0)
    p1 = _x_pairs(x_ptr, kc, m_k, x_scale, 1)
    p2 = _x_pairs(x_ptr, kc, m_k, x_scale, 2)
    p3 = _x_pairs(x_ptr, kc, m_k, x_scale, 3)
    return (p0[0], p0[1], p0[2], p0[3], p1[0], p1[1], p1[2], p1[3], p2[0], p2[1], p2[2], p2[3],
            p3[0], p3[1], p3[2], p3[3]), x_scale


@triton.jit
def _chunk_dot(w0, w1, w2, w3, s2, xp, USE_ASM: tl.constexpr):
    """One 32-code chunk (4 words, 2 groups) against one x row's 16 pairs: fp32 scaled partial."""
    a0, a1, a2, a3 = _decode_word(w0, USE_ASM)
    b0, b1, b2, b3 = _decode_word(w1, USE_ASM)
    c0 = _chain((a0, a1, a2, a3, b0, b1, b2, b3), (xp[0], xp[1], xp[2], xp[3], xp[4], xp[5], xp[6], xp[7]),
                USE_ASM)
    d0, d1, d2, d3 = _decode_word(w2, USE_ASM)
    e0, e1, e2, e3 = _decode_word(w3, USE_ASM)
    c1 = _chain((d0, d1, d2, d3, e0, e1, e2, e3),
                (xp[8], xp[9], xp[10], xp[11], xp[12], xp[13], xp[14], xp[15]), USE_ASM)
    return _tail(c0, c1, s2, USE_ASM)


@triton.jit
def _chunk_dot2(w0, w1, w2, w3, s2, xa, xb, USE_ASM: tl.constexpr):
    """As `_chunk_dot` for two x rows, the words decoded once."""
    a0, a1, a2, a3 = _decode_word(w0, USE_ASM)
    b0, b1, b2, b3 = _decode_word(w1, USE_ASM)
    d0, d1, d2, d3 = _decode_word(w2, USE_ASM)
    e0, e1, e2, e3 = _decode_word(w3, USE_ASM)
    g0 = (a0, a1, a2, a3, b0, b1, b2, b3)
    g1 = (d0, d1, d2, d3, e0, e1, e2, e3)
    va = _tail(_chain(g0, (xa[0], xa[1], xa[2], xa[3], xa[4], xa[5], xa[6], xa[7]), USE_ASM),
               _chain(g1, (xa[8], xa[9], xa[10], xa[11], xa[12], xa[13], xa[14], xa[15]), USE_ASM), s2, USE_ASM)
    vb = _tail(_chain(g0, (xb[0], xb[1], xb[2], xb[3], xb[4], xb[5], xb[6], xb[7]), USE_ASM),
               _chain(g1, (xb[8], xb[9], xb[10], xb[11], xb[12], xb[13], xb[14], xb[15]), USE_ASM), s2, USE_ASM)
    return va, vb


@triton.jit
def _load_rows(w_ptr, s_ptr, rows, row_last, kw0, kw_last, row_w, C: tl.constexpr, USE_ASM: tl.constexpr):
    """The [BN, C, 128] words of these rows (lane l: words 4l..4l+3 of each chunk, one 16-byte load) and their
    [BN, C, 32] scale pairs. The word axis is the last and contiguous, so that Triton lays 32 lanes along it and the
    warps along the rows (a lane's chunks and rows then never leave its registers). No masks: rows past the run
    and chunks past the slice read the last valid row / chunk instead (their x is 0 and their y not stored), so
    that no load needs a predicate or a zeroed destination."""
    BN: tl.constexpr = rows.shape[0]
    o_i = tl.arange(0, 128)[None, None, :]
    # lane l's chunk c starts at word kw0 + c * 128 + 4 l, clamped to the slice's last chunk (the clamp does not
    # depend on the row: hoisted out of the loop)
    o_c = tl.minimum(kw0 + tl.arange(0, C)[None, :, None] * 128 + o_i // 4 * 4, kw_last)
    r = tl.minimum(rows, row_last)[:, None, None]
    w = tl.load(w_ptr + r * row_w + o_c + o_i % 4)
    # the scale pair of a chunk: row * (row_w / 4) + its first word / 4, built in the words' layout and split like
    # them so that it keeps their layout
    s_off, _ = tl.split(tl.split(tl.reshape(r * (row_w // 4) + o_c // 4, (BN, C, 32, 2, 2)))[0])
    if USE_ASM:     # a plain tl.load would get a layout of its own (Triton's coalescing) and a shared-memory move
        s2 = tl.inline_asm_elementwise(LD_U16_ASM, "=r,l", [s_ptr + s_off], dtype=tl.uint32, is_pure=True,
                                       pack=1)
    else:
        s2 = tl.load(s_ptr + s_off).to(tl.uint32)
    return w, s2


@triton.jit
def _row_sums(v, USE_ASM: tl.constexpr):
    """[BN, C, 32] fp16 pairs -> [BN] fp32: the lane's chunks summed in fp16 (in its registers), its two lanes in
    fp32, then the 32 lanes (one warp reduction per row)."""
    if v.shape[1] > 1:
        v = tl.reduce(v, 1, _hadd2)
    else:
        v = tl.reshape(v, (v.shape[0], v.shape[2]))
    return tl.sum(_lanes_f32(v, USE_ASM), axis=1)


@triton.jit
def _store_rows(y_ptr, stride_ym, part_ptr, j, N, M_PAD: tl.constexpr, m, v, rows, m_r, undo, SPLIT: tl.constexpr):
    if SPLIT:
        tl.store(part_ptr + (j * M_PAD + m) * N + rows, v * undo, mask=m_r)
    else:
        tl.store(y_ptr + m * stride_ym + rows, (v * undo).to(y_ptr.dtype.element_ty), mask=m_r)


@triton.jit
def _block(w4, s2, rb, row_end, gs, xa, xs_a, xb, xs_b, y_ptr, stride_ym, part_ptr, j, N, M, M_PAD: tl.constexpr,
           USE_ASM: tl.constexpr, SPLIT: tl.constexpr, PROBE: tl.constexpr):
    """One row block: the words split into the 4 of each lane's chunk, the products, the row sums, the stores."""
    BN: tl.constexpr = w4.shape[0]
    C: tl.constexpr = w4.shape[1]
    w01, w23 = tl.split(tl.reshape(w4, (BN, C, 32, 2, 2)))
    w0, w2 = tl.split(w01)
    w1, w3 = tl.split(w23)
    rows = rb + tl.arange(0, BN)
    m_r = rows < row_end
    if PROBE:
        v = (w0 + w1 + w2 + w3 + s2).to(tl.float32)
        _store_rows(y_ptr, stride_ym, part_ptr, j, N, M_PAD, 0, tl.sum(tl.sum(v, axis=1), axis=1), rows, m_r, 1.0,
                    SPLIT)
    elif M_PAD == 1:
        v = _chunk_dot(w0, w1, w2, w3, s2, xa, USE_ASM)
        _store_rows(y_ptr, stride_ym, part_ptr, j, N, M_PAD, 0, _row_sums(v, USE_ASM), rows, m_r, gs / xs_a, SPLIT)
    else:
        va, vb = _chunk_dot2(w0, w1, w2, w3, s2, xa, xb, USE_ASM)
        _store_rows(y_ptr, stride_ym, part_ptr, j, N, M_PAD, 0, _row_sums(va, USE_ASM), rows, m_r, gs / xs_a, SPLIT)
        _store_rows(y_ptr, stride_ym, part_ptr, j, N, M_PAD, 1, _row_sums(vb, USE_ASM), rows, m_r & ((rows * 0 + 1) < M),
                    gs / xs_b, SPLIT)


@triton.jit
def _join_slices(y_ptr, stride_ym, part_ptr, cnt_ptr, pid, row0, row_end, n_slices, N, M, M_PAD: tl.constexpr,
                 BN: tl.constexpr):
    """The split-K join of a row run (this kernel's and kernels/gemv_fp8_fma.py's): the last of its slices to arrive
    sums the fp32 partials in slice order (deterministic) and stores y, then resets the run's counter."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if arrived == n_slices - 1:
        for rb in range(row0, row_end, BN):
            rows = rb + tl.arange(0, BN)
            m_r = rows < row_end
            for m in tl.static_range(M_PAD):
                acc = tl.zeros([BN], dtype=tl.float32)
                for jj in range(n_slices):
                    acc += tl.load(part_ptr + (jj * M_PAD + m) * N + rows, mask=m_r, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + m * stride_ym + rows, acc.to(y_ptr.dtype.element_ty), mask=m_r & ((rows * 0 + m) < M))
        tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")


@triton.jit(**backend.varying("rows_per_prog"))
def _nvfp4_gemv_fma_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_ym, row_w, row_s2, slice_w, rows_per_prog,
    M_PAD: tl.constexpr, C: tl.constexpr, R: tl.constexpr, NUM_WARPS: tl.constexpr,
    USE_ASM: tl.constexpr, SPLIT: tl.constexpr, PROBE: tl.constexpr = False,
):
    """See the module docstring. w_ptr: the codes as uint32 words [N, row_w]; s_ptr: the scales as uint16 pairs
    [N, row_s2]; slice_w: words per K-slice (a multiple of 4); rows_per_prog: rows per program (grid axis 0)."""
    BN: tl.constexpr = R * NUM_WARPS
    pid = tl.program_id(0)
    j = tl.program_id(1)
    n_slices = tl.num_programs(1)
    row0 = pid * rows_per_prog
    row_end = tl.minimum(row0 + rows_per_prog, N)
    kw0 = j * slice_w
    kw_end = tl.minimum(kw0 + slice_w, row_w)
    # [1, C, 32]: the first word of lane l's chunk c (4 words, 32 codes); x is read at these codes
    kw = kw0 + tl.arange(0, C)[None, :, None] * 128 + tl.arange(0, 32)[None, None, :] * 4
    m_k = kw < kw_end
    o_r = tl.arange(0, BN)
    w_a, s_a = _load_rows(w_ptr, s_ptr, row0 + o_r, row_end - 1, kw0, kw_end - 4, row_w, C, USE_ASM)
    w_b, s_b = _load_rows(w_ptr, s_ptr, row0 + BN + o_r, row_end - 1, kw0, kw_end - 4, row_w, C, USE_ASM)
    gs = tl.load(gs_ptr) * 16384.0
    xa, xs_a = _x_row(x_ptr, kw * 8, m_k)
    xb, xs_b = xa, xs_a
    if M_PAD == 2:
        xb, xs_b = _x_row(x_ptr + stride_xm, kw * 8, m_k & ((kw * 0 + 1) < M))
    # two row blocks per trip, each buffer refilled right after it is consumed: the other block's words are in
    # flight while these are decoded (Triton does not pipeline loads that feed no dot), and no register moves
    # between buffers (a one-block loop that loaded the next block first carried it in ~32 moves per trip)
    for rb in range(row0, row_end, 2 * BN):
        _block(w_a, s_a, rb, row_end, gs, xa, xs_a, xb, xs_b, y_ptr, stride_ym, part_ptr, j, N, M, M_PAD, USE_ASM,
               SPLIT, PROBE)
        w_a, s_a = _load_rows(w_ptr, s_ptr, rb + 2 * BN + o_r, row_end - 1, kw0, kw_end - 4, row_w, C, USE_ASM)
        _block(w_b, s_b, rb + BN, row_end, gs, xa, xs_a, xb, xs_b, y_ptr, stride_ym, part_ptr, j, N, M, M_PAD,
               USE_ASM, SPLIT, PROBE)
        w_b, s_b = _load_rows(w_ptr, s_ptr, rb + 3 * BN + o_r, row_end - 1, kw0, kw_end - 4, row_w, C, USE_ASM)
    if SPLIT:
        _join_slices(y_ptr, stride_ym, part_ptr, cnt_ptr, pid, row0, row_end, n_slices, N, M, M_PAD, BN)


# ---- the wrapper

def fma_config(M: int, N: int, K: int, device, config: dict | None = None, n_sm: int | None = None) -> dict:
    """C (chunks of 1,024 codes in a K-slice), R (rows per warp per row block), warps, PPS (programs per SM in the
    grid), SLICES. Defaults from the SASS counts (Triton 3.6, sm_90): M = 1 C 4, R 1 (165 registers, 3 programs an
    SM, 24 KB of words in flight an SM); M = 2 C 1, R 2 (96 registers, 5 an SM); K cut into the fewest slices of at
    most C x 1,024 codes, as even as 32-code chunks allow."""
    m_pad = 1 if M <= 1 else 2
    cfg = dict(C=4, R=1, num_warps=4, PPS=3, num_stages=1) if m_pad == 1 else \
        dict(C=1, R=2, num_warps=4, PPS=5, num_stages=1)
    cfg["C"] = min(cfg["C"], triton.next_power_of_2(triton.cdiv(K, 1024)))    # K = 1,024: no idle chunks
    cfg.update(config or {})
    return plan_slices(cfg, m_pad, N, K, 32, device, n_sm)


def plan_slices(cfg: dict, m_pad: int, N: int, K: int, lane_codes: int, device, n_sm: int | None) -> dict:
    """The grid of an FMA GEMV (this one's and kernels/gemv_fp8_fma.py's): K cut into the fewest slices of at most
    C x 32 x `lane_codes` codes, as even as a lane's chunk of `lane_codes` codes (one 16-byte load) allows; rows
    spread over PPS programs an SM per slice. Adds M_PAD, SLICES, slice_w (32-bit words a slice), rows_per_prog and
    programs to `cfg`."""
    cap = cfg["C"] * 32 * lane_codes
    slices = cfg.get("SLICES") or triton.cdiv(K, cap)
    chunks = triton.cdiv(K // lane_codes, slices)       # lane chunks per slice
    if chunks * lane_codes > cap:
        raise ValueError(f"K = {K} in {slices} slices needs {chunks * lane_codes} codes a slice > C x "
                         f"{32 * lane_codes:,} = {cap}")
    cfg.update(M_PAD=m_pad, SLICES=triton.cdiv(K // lane_codes, chunks), slice_w=chunks * 4)
    n_sm = n_sm or _n_sm(device)
    per_slice = max(1, cfg["PPS"] * n_sm // cfg["SLICES"])
    cfg["rows_per_prog"] = triton.cdiv(N, per_slice)
    cfg["programs"] = triton.cdiv(N, cfg["rows_per_prog"])
    return cfg


def launch_buffers(x: torch.Tensor, K: int, N: int, cfg: dict, out_dtype, out: torch.Tensor | None, name: str):
    """(x2 [M, K] with unit stride, the leading shape, y, the fp32 partials, the arrival counters) of an FMA GEMV
    launch; without a split the partials and counters are y (not read)."""
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] > 2:
        raise ValueError(f"M = {x2.shape[0]}: the {name} takes 1-2 rows of x")
    y = out if out is not None else torch.empty((x2.shape[0], N), dtype=out_dtype, device=x.device)
    if cfg["SLICES"] == 1:
        return x2, x.shape[:-1], y, y, y
    part = torch.empty((cfg["SLICES"], cfg["M_PAD"], N), dtype=torch.float32, device=x.device)
    return x2, x.shape[:-1], y, part, _arrival_counters(x.device, cfg["programs"])


def nvfp4_linear_fma(x: torch.Tensor, weight_u8: torch.Tensor, weight_scale_e4m3: torch.Tensor, global_scale,
                     out_dtype=None, config: dict | None = None, out: torch.Tensor | None = None,
                     probe: bool = False) -> torch.Tensor:
    """y = x @ W.T for M <= 2 rows of x, W NVFP4 (U8 [N, K/2], e4m3 [N, K/16], global fp32): one launch.
    K must be a multiple of 32 (16-byte rows of codes: one LDG.128 per 32 codes). probe=True: the read probe
    (same grid and loads, no decode; y holds integer sums, not a product)."""
    N, K = weight_u8.shape[0], weight_u8.shape[1] * 2
    assert x.shape[-1] == K and weight_scale_e4m3.shape == (N, K // 16), (x.shape, weight_scale_e4m3.shape)
    assert weight_u8.is_contiguous() and weight_scale_e4m3.is_contiguous()
    if K % 32:
        raise ValueError(f"K = {K}: the FMA GEMV reads 16-byte words of codes, K must be a multiple of 32")
    out_dtype = out_dtype or x.dtype
    M = x.numel() // K
    if M > 2:
        raise ValueError(f"M = {M}: the FMA GEMV takes 1-2 rows of x")
    cfg = fma_config(M, N, K, x.device, config)
    x2, lead, y, part, cnt = launch_buffers(x, K, N, cfg, out_dtype, out, "FMA GEMV")
    split = cfg["SLICES"] > 1
    grid = (cfg["programs"], cfg["SLICES"])
    _nvfp4_gemv_fma_kernel[grid](
        x2, weight_u8.view(torch.uint32), _as_u8(weight_scale_e4m3).view(torch.uint16), _global(global_scale, x.device),
        y, part, cnt, M, N, K, x2.stride(0), y.stride(0), K // 8, K // 32, cfg["slice_w"], cfg["rows_per_prog"],
        M_PAD=cfg["M_PAD"], C=cfg["C"], R=cfg["R"], NUM_WARPS=cfg["num_warps"],
        USE_ASM=cfg.get("USE_ASM", not backend.interpreted()), SPLIT=split, PROBE=probe,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg
                                                                     else {}))
    return (y if y.dtype == out_dtype else y.to(out_dtype)).reshape(*lead, N)
