"""The FP8 decode GEMV on the CUDA cores (issue 19, part 1: "FP8 GEMV ... >= 80 %"; session 36).

Where it runs: `kernels.gemv_nvfp4.fp8_linear` calls `fp8_linear_fma` when the shape's FP8_GEMV_CHOICES entry carries
an 'FMA' key (sm_90, M = 1: every Super FP8 shape); MOESTREAM_GEMV_FMA=0 turns those keys off, as it does the NVFP4
FMA GEMV's. It lost at M = 2 (the decode of one word feeds two chains), so M = 2 stays on the tensor cores. The
experiments around it (SASS counts; the sweep: `python -m bench.kernels.gemv_fma_sweep --fp8`) are in
bench/kernels/gemv_fp8_fma.py, their record in bench/NOTES.md, session 36.

    y[m, n] = scale * sum_k e4m3[n, k] * x[m, k]

Why: the real Super checkpoint keeps ~4.8 GB of its dense weights per token in per-tensor FP8 (28 Mamba in_proj, 29
out_proj, most shared-expert up / down: reference/nemotron-h-format.md), read once per token. An e4m3 pair becomes an
fp16 pair in one instruction (cvt.rn.f16x2.e4m3x2, exact): 1.54 instructions a weight at C = 8 (SASS), against the
NVFP4 FMA kernel's 2.45. Measured on an H100 (read ceiling 3.1 TB/s), µs tensor cores -> this kernel: in_proj 40.0 ->
28.4 (61 -> 86 % of the read ceiling), out_proj 18.2 -> 16.8, shared up 15.1 -> 10.9, down 14.2 -> 13.3, fc1 7.3 ->
4.9; the Super token's FP8 GEMVs 2.81 -> 2.24 ms. Its read probe (PROBE: the same grid and loads, no products) runs
no faster, and at C = 4 (two K-slices at K = 4,096) in_proj took 34.6: the kernel is bound by how long a contiguous
run of a row each program reads, not by its instructions, hence C up to 8.

The layout is kernels/gemv_nvfp4_fma.py's: a program owns a K-slice j (grid axis 1) of at most C x 512 codes and a
run of `rows_per_prog` rows (grid axis 0); lane l of each warp owns the 16-byte chunks c * 512 + l * 16 of the slice
(16 codes, 4 words), so its x values are loaded, scaled and paired once per program; per row and chunk a lane loads
one 16-byte word (LDG.128), converts it into 8 fp16 pairs, runs one chain of 8 HFMA2 against its x pairs; the C
chunks' pairs are summed in fp16, the two lanes in fp32, the 32 lanes in one warp reduction; split K joins in slice
order by the last program to arrive (deterministic, no atomics on y), as the NVFP4 kernel does.

Precision (fp16 sums): x is scaled per program and row by a power of two so that max |x| of the slice lies in
[2^(X - 1), 2^X) with X = 4 - log2(C) (`x_top`): a product is <= 448 * 2^X, a chain of 8 <= 3,584 * 2^X, the C chunks
<= 57,344 < 65,504 (no overflow for any x or weight; C <= 8), and x stays normal in fp16 down to max |x| * 2^-(13 + X)
(C = 8: 2^-14). Rounding: fp16 per HFMA2, ~1e-3 relative on a row (the engine's bf16 checks allow 5e-3). e4m3 NaN
codes (0x7F, 0xFF) are not weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.gemv_nvfp4 import _as_u8, _global
from kernels.gemv_nvfp4_fma import _chain, _join_slices, _row_sums, _store_rows, launch_buffers, plan_slices

# one word (4 e4m3 codes, byte 0 first) -> 2 fp16 pairs: (code 0, code 1), (code 2, code 3), exact
DECODE_FP8_PTX = "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi;}"
DECODE_FP8_ASM = tl.constexpr(DECODE_FP8_PTX)
C_MAX = 8                            # chunks a lane sums in fp16 (the overflow bound above)


def x_top(c: int) -> int:
    """The power of two x's largest value is scaled below for C chunks a lane: C x 8 x 448 x 2^X_TOP = 57,344."""
    return 4 - (c.bit_length() - 1)


@triton.jit
def _e4m3_half(b):
    """One e4m3 code (the low byte of b) as its fp16 bit pattern in a uint32 (interpreter path)."""
    v = (b & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.float16)
    return v.to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _decode_fp8_word(r, USE_ASM: tl.constexpr):
    """uint32 word (codes 0-3) -> fp16 pairs (codes 0, 1) and (codes 2, 3) as uint32 bit patterns."""
    if USE_ASM:
        p0, p1 = tl.inline_asm_elementwise(DECODE_FP8_ASM, "=r,=r,r", [r], dtype=(tl.uint32, tl.uint32),
                                           is_pure=True, pack=1)
    else:
        p0 = _e4m3_half(r) | (_e4m3_half(r >> 8) << 16)
        p1 = _e4m3_half(r >> 16) | (_e4m3_half(r >> 24) << 16)
    return p0, p1


@triton.jit
def _x_code(x_ptr, kc, m_k, i: tl.constexpr, x_scale):
    v = (tl.load(x_ptr + kc + i, mask=m_k, other=0.0).to(tl.float32) * x_scale).to(tl.float16)
    return v.to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _x_row_fp8(x_ptr, kc, m_k, X_TOP: tl.constexpr):
    """(the 8 x pairs (x[2p], x[2p + 1]) of each lane chunk's 16 codes, the power of two x was scaled by)."""
    a = tl.zeros(kc.shape, dtype=tl.float32)
    for i in tl.static_range(16):
        a = tl.maximum(a, tl.abs(tl.load(x_ptr + kc + i, mask=m_k, other=0.0).to(tl.float32)))
    amax = tl.max(tl.max(tl.max(a, axis=2), axis=1), axis=0)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, tl.full([], X_TOP - 1, tl.int32)), 254)    # an all-zero slice: any scale
    # 2^(X_TOP + 126 - e): max |x| in [2^(e-127), 2^(e-126)) maps into [2^(X_TOP-1), 2^X_TOP)
    x_scale = ((tl.full([], X_TOP + 253, tl.int32) - e) << 23).to(tl.float32, bitcast=True)
    return ((_x_code(x_ptr, kc, m_k, 0, x_scale) | (_x_code(x_ptr, kc, m_k, 1, x_scale) << 16)),
            (_x_code(x_ptr, kc, m_k, 2, x_scale) | (_x_code(x_ptr, kc, m_k, 3, x_scale) << 16)),
            (_x_code(x_ptr, kc, m_k, 4, x_scale) | (_x_code(x_ptr, kc, m_k, 5, x_scale) << 16)),
            (_x_code(x_ptr, kc, m_k, 6, x_scale) | (_x_code(x_ptr, kc, m_k, 7, x_scale) << 16)),
            (_x_code(x_ptr, kc, m_k, 8, x_scale) | (_x_code(x_ptr, kc, m_k, 9, x_scale) << 16)),
            (_x_code(x_ptr, kc, m_k, 10, x_scale) | (_x_code(x_ptr, kc, m_k, 11, x_scale) << 16)),
            (_x_code(x_ptr, kc, m_k, 12, x_scale) | (_x_code(x_ptr, kc, m_k, 13, x_scale) << 16)),
            (_x_code(x_ptr, kc, m_k, 14, x_scale) | (_x_code(x_ptr, kc, m_k, 15, x_scale) << 16))), x_scale


@triton.jit
def _load_words(w_ptr, rows, row_last, kw0, kw_last, row_w, C: tl.constexpr, EVICT: tl.constexpr):
    """The [BN, C, 128] words of these rows (lane l: words 4l..4l+3 of each chunk, one 16-byte load), rows past the
    run and chunks past the slice clamped to the last valid ones (their x is 0 and their y not stored). EVICT: the
    words marked first out of the L2 (read once; x and the partials stay): level within 1 % (session 36, H100)."""
    o_i = tl.arange(0, 128)[None, None, :]
    o_c = tl.minimum(kw0 + tl.arange(0, C)[None, :, None] * 128 + o_i // 4 * 4, kw_last)
    r = tl.minimum(rows, row_last)[:, None, None]
    if EVICT:
        w = tl.load(w_ptr + r * row_w + o_c + o_i % 4, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptr + r * row_w + o_c + o_i % 4)
    return w


@triton.jit
def _chunk_pairs(w4, USE_ASM: tl.constexpr):
    """[BN, C, 128] words -> the 8 fp16 pairs of each lane chunk, in code order."""
    BN: tl.constexpr = w4.shape[0]
    C: tl.constexpr = w4.shape[1]
    w01, w23 = tl.split(tl.reshape(w4, (BN, C, 32, 2, 2)))
    w0, w2 = tl.split(w01)
    w1, w3 = tl.split(w23)
    a0, a1 = _decode_fp8_word(w0, USE_ASM)
    b0, b1 = _decode_fp8_word(w1, USE_ASM)
    c0, c1 = _decode_fp8_word(w2, USE_ASM)
    d0, d1 = _decode_fp8_word(w3, USE_ASM)
    return (a0, a1, b0, b1, c0, c1, d0, d1), w0 + w1 + w2 + w3


@triton.jit
def _fp8_block(w4, rb, row_end, gs, xa, xs_a, xb, xs_b, y_ptr, stride_ym, part_ptr, j, N, M, M_PAD: tl.constexpr,
               USE_ASM: tl.constexpr, SPLIT: tl.constexpr, PROBE: tl.constexpr):
    BN: tl.constexpr = w4.shape[0]
    rows = rb + tl.arange(0, BN)
    m_r = rows < row_end
    wp, wsum = _chunk_pairs(w4, USE_ASM)
    if PROBE:
        v = wsum.to(tl.float32)
        _store_rows(y_ptr, stride_ym, part_ptr, j, N, M_PAD, 0, tl.sum(tl.sum(v, axis=1), axis=1), rows, m_r, 1.0,
                    SPLIT)
    else:
        va = _chain(wp, xa, USE_ASM)
        _store_rows(y_ptr, stride_ym, part_ptr, j, N, M_PAD, 0, _row_sums(va, USE_ASM), rows, m_r, gs / xs_a, SPLIT)
        if M_PAD == 2:
            vb = _chain(wp, xb, USE_ASM)
            _store_rows(y_ptr, stride_ym, part_ptr, j, N, M_PAD, 1, _row_sums(vb, USE_ASM), rows,
                        m_r & ((rows * 0 + 1) < M), gs / xs_b, SPLIT)


@triton.jit(**backend.varying("rows_per_prog"))
def _fp8_gemv_fma_kernel(
    x_ptr, w_ptr, gs_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_ym, row_w, slice_w, rows_per_prog,
    M_PAD: tl.constexpr, C: tl.constexpr, R: tl.constexpr, NUM_WARPS: tl.constexpr,
    USE_ASM: tl.constexpr, SPLIT: tl.constexpr, X_TOP: tl.constexpr, EVICT: tl.constexpr = False,
    PROBE: tl.constexpr = False,
):
    """See the module docstring. w_ptr: the codes as uint32 words [N, row_w]; slice_w: words per K-slice (a multiple
    of 4); rows_per_prog: rows per program (grid axis 0)."""
    BN: tl.constexpr = R * NUM_WARPS
    pid = tl.program_id(0)
    j = tl.program_id(1)
    n_slices = tl.num_programs(1)
    row0 = pid * rows_per_prog
    row_end = tl.minimum(row0 + rows_per_prog, N)
    kw0 = j * slice_w
    kw_end = tl.minimum(kw0 + slice_w, row_w)
    # [1, C, 32]: the first word of lane l's chunk c (4 words, 16 codes); x is read at these codes
    kw = kw0 + tl.arange(0, C)[None, :, None] * 128 + tl.arange(0, 32)[None, None, :] * 4
    m_k = kw < kw_end
    o_r = tl.arange(0, BN)
    w_a = _load_words(w_ptr, row0 + o_r, row_end - 1, kw0, kw_end - 4, row_w, C, EVICT)
    w_b = _load_words(w_ptr, row0 + BN + o_r, row_end - 1, kw0, kw_end - 4, row_w, C, EVICT)
    gs = tl.load(gs_ptr)
    xa, xs_a = _x_row_fp8(x_ptr, kw * 4, m_k, X_TOP)
    xb, xs_b = xa, xs_a
    if M_PAD == 2:
        xb, xs_b = _x_row_fp8(x_ptr + stride_xm, kw * 4, m_k & ((kw * 0 + 1) < M), X_TOP)
    # two row blocks per trip, each buffer refilled right after it is consumed (kernels/gemv_nvfp4_fma.py's loop)
    for rb in range(row0, row_end, 2 * BN):
        _fp8_block(w_a, rb, row_end, gs, xa, xs_a, xb, xs_b, y_ptr, stride_ym, part_ptr, j, N, M, M_PAD, USE_ASM,
                   SPLIT, PROBE)
        w_a = _load_words(w_ptr, rb + 2 * BN + o_r, row_end - 1, kw0, kw_end - 4, row_w, C, EVICT)
        _fp8_block(w_b, rb + BN, row_end, gs, xa, xs_a, xb, xs_b, y_ptr, stride_ym, part_ptr, j, N, M, M_PAD,
                   USE_ASM, SPLIT, PROBE)
        w_b = _load_words(w_ptr, rb + 3 * BN + o_r, row_end - 1, kw0, kw_end - 4, row_w, C, EVICT)
    if SPLIT:
        _join_slices(y_ptr, stride_ym, part_ptr, cnt_ptr, pid, row0, row_end, n_slices, N, M, M_PAD, BN)


# ---- the wrapper

def fp8_fma_config(M: int, N: int, K: int, device, config: dict | None = None, n_sm: int | None = None) -> dict:
    """C (chunks of 512 codes in a K-slice, <= C_MAX), R (rows per warp per row block), warps, PPS (programs per SM
    in the grid), SLICES: kernels.gemv_nvfp4_fma.fma_config's rule with 512-code chunks (16 codes a lane). X_TOP
    (a test's knob): the power of two x is scaled below, `x_top(C)` by default; above it the fp16 sums can overflow."""
    m_pad = 1 if M <= 1 else 2
    # M = 1: the longest slices (session 36, H100: C 8 > 4 > 2 > 1 on every shape, the probe alike; in_proj at this
    # default 28.7 µs, 85 % of the read ceiling); 161 registers at C 8, 3 programs an SM
    cfg = dict(C=8, R=1, num_warps=4, PPS=3, num_stages=1) if m_pad == 1 else \
        dict(C=4, R=1, num_warps=4, PPS=3, num_stages=1)
    cfg["C"] = min(cfg["C"], triton.next_power_of_2(triton.cdiv(K, 512)))    # K = 512: no idle chunks
    cfg.update(config or {})
    if not 1 <= cfg["C"] <= C_MAX or cfg["C"] & (cfg["C"] - 1):
        raise ValueError(f"C = {cfg['C']}: the FP8 FMA GEMV sums a power of two of at most {C_MAX} chunks in fp16")
    cfg.setdefault("X_TOP", x_top(cfg["C"]))
    return plan_slices(cfg, m_pad, N, K, 16, device, n_sm)


def fp8_linear_fma(x: torch.Tensor, weight_e4m3: torch.Tensor, scale, out_dtype=None, config: dict | None = None,
                   out: torch.Tensor | None = None, probe: bool = False) -> torch.Tensor:
    """y = x @ W.T for M <= 2 rows of x, W per-tensor FP8 (e4m3 [N, K], fp32 scale): one launch. K must be a multiple
    of 16 (one 16-byte load per lane chunk). probe=True: the read probe (same grid and loads, no products; y holds
    integer sums, not a product)."""
    N, K = weight_e4m3.shape
    assert x.shape[-1] == K, (x.shape, weight_e4m3.shape)
    assert weight_e4m3.is_contiguous()
    if K % 16:
        raise ValueError(f"K = {K}: the FP8 FMA GEMV reads 16-byte words of codes, K must be a multiple of 16")
    out_dtype = out_dtype or x.dtype
    M = x.numel() // K
    if M > 2:
        raise ValueError(f"M = {M}: the FP8 FMA GEMV takes 1-2 rows of x")
    cfg = fp8_fma_config(M, N, K, x.device, config)
    x2, lead, y, part, cnt = launch_buffers(x, K, N, cfg, out_dtype, out, "FP8 FMA GEMV")
    split = cfg["SLICES"] > 1
    grid = (cfg["programs"], cfg["SLICES"])
    _fp8_gemv_fma_kernel[grid](
        x2, _as_u8(weight_e4m3).view(torch.uint32), _global(scale, x.device), y, part, cnt, M, N, K, x2.stride(0),
        y.stride(0), K // 4, cfg["slice_w"], cfg["rows_per_prog"],
        M_PAD=cfg["M_PAD"], C=cfg["C"], R=cfg["R"], NUM_WARPS=cfg["num_warps"],
        USE_ASM=cfg.get("USE_ASM", not backend.interpreted()), SPLIT=split, X_TOP=cfg["X_TOP"],
        EVICT=bool(cfg.get("EVICT", False)), PROBE=probe,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}))
    return (y if y.dtype == out_dtype else y.to(out_dtype)).reshape(*lead, N)
