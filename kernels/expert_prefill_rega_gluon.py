"""The expert prefill kernels the engine runs on sm_90 (issue 13, part 2): NVFP4 decoded straight into wgmma's
register operand, written in Gluon (Triton's explicit-layout dialect; Triton 3.6's API, the device's, and 3.9's).
kernels/expert_prefill_rega.py has the scheme (x permuted so that a code word's nibble pairs are the operand's
column pairs) and its Triton twin, which the CPU tests run; `expert_prefill_grouped` routes here (path "rega").

What runs (session 40's winner, bench/NOTES.md: "d5tw"; the variants it beat are in
bench/kernels/expert_prefill_rega_gluon.py with their timings):
- One CTA a tile of BLOCK_M (256) rows of one expert and BLOCK_N (128) output columns; 8 warps, two warpgroups.
- The words are loaded straight into the register operand's layout (DotOperandLayout of the MMA, k_width 2): lane c
  of a quad gets words p = c and c + 4 of each row and half block. DECODE_PTX turns each word into the fp16 pairs
  (q, q + 4) of four K = 16 dots, the e4m3 scale is multiplied in fp16 (exact), and each half block goes to one
  K = 64 `warpgroup_mma` while the next block's words are decoded.
- x (the up's) and h (the down's) come through TMA into a ring of STAGES blocks of two [BLOCK_M, 64] swizzled boxes,
  one mbarrier a stage.
- The up's rows are taken in x's permuted order (row r of a tile is h's column n0 + r), so its epilogue stores h
  8 columns a thread (16-byte stores); the down adds into the layer's accumulator 4 columns a thread (vector
  `red.add.f32x4`).
- Numbers: e2m1 · 2^-14 by bit moves, the scale · 2^7, x · 2^-8 in fp16, fp32 accumulation, h = ReLU² · 2^-8 in
  fp16 (the down's x); the global scales · 2^15 in the epilogues.
Measured (H100, session 40, the kernels alone, up and down together, % of the bf16 GEMM of the same run): 46-52 % at
256 rows an expert, 54-60 % at 1,024; the engine's dequantized path 19-28 % / 52-53 %; cuBLAS on bf16 weights of
the same shapes 63-64 % / 87-93 %.

PROBE and STORE 0 (bench only, wrong numbers or the old stores) stay flags of these kernels so that the bench's
probes cannot drift from what runs. No interpreter path: Gluon kernels run on a GPU only; the CPU tests compile them
for sm_90 (bench.kernels.expert_prefill_rega_gluon.compile_offline) and check the SASS for spills and operand
hazards.
"""
from __future__ import annotations

import functools

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.backend import varying
from kernels.expert_prefill_rega import permuted_pos, source_col, tile_entry
from kernels.gemv_nvfp4_fma import DECODE_PTX

# Gluon renamed its TMA load and its CTA barrier after 3.6 (the device's)
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier          # (3.6's name)

# the engine's config (session 40's "d5tw"): 256-row tiles decode each weight once for 256 rows
TMA_CONFIG = dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, num_warps=8)

DECODE = gl.constexpr(DECODE_PTX)


@functools.lru_cache(maxsize=None)
def x_layout(block_m: int):
    """The ring's shared layout (a [block_m, 64] fp16 TMA box, 128-byte swizzle: what wgmma's B reads). Built once a
    block_m: Gluon builds it through a constexpr function call, ~5 % of a rega launch's host time when built twice a
    launch (py-spy, H100 session 43 call 3: 755 samples under the budgeted prompts' `_prefill_batch`)."""
    return gl.NVMMASharedLayout.get_default_for([block_m, 64], gl.float16)


@gluon.jit
def _half(base, s_base, w_offs, s_offs, m_n, j2, blk, w_step, s_step, n_words, H: gl.constexpr):
    """Words 8 H + j // 2 of 128-block blk for every column j of the register operand (each word twice: the
    columns 2p and 2p + 1 of a pair), and their e4m3 scales."""
    m_w = m_n & (blk * 16 + 8 * H + j2 // 2 < n_words)
    w = gl.load((base + (w_offs + blk * w_step)).to(gl.pointer_type(gl.int32)), mask=m_w, other=0)
    s = gl.load(s_base + (s_offs + blk * s_step), mask=m_w, other=0)
    return w, s


@gluon.jit
def _pairs(w):
    """The four fp16 pairs (q, q + 4) of each word, q = 0..3 (DECODE_PTX: e2m1 · 2^-14, exact)."""
    return gl.inline_asm_elementwise(DECODE, "=r,=r,=r,=r,r,r", [w],
                                     dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2)


@gluon.jit
def _word_offsets(n0, N, K, LAYOUT: gl.constexpr, a_l: gl.constexpr, BLOCK_N: gl.constexpr):
    """The words' and scales' offsets of rows n0 .. n0 + BLOCK_N in block 0, in the register operand's layout a_l
    (column j of half H is word 8 H + j // 2, group 4 H + j // 4), their row mask, and the steps to the next block
    and to the second half. LAYOUT 0: the up's row-major words, row r of the tile the I that h's column n0 + r
    holds (x's permutation applied to the rows: the store writes h's columns in order); 2: the same words in their
    own order (STORE 0, bench only); 1: the down's interleaved groups."""
    o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
    if LAYOUT == 0:
        o_n = source_col(o_n)
    o_j = gl.arange(0, 16, layout=gl.SliceLayout(0, a_l))
    n2 = gl.expand_dims(o_n, 1).to(gl.int64)
    j2 = gl.expand_dims(o_j, 0)
    if LAYOUT != 1:
        w0 = n2 * (K // 2) + 4 * (j2 // 2)
        s0 = n2 * (K // 16) + j2 // 4
        return w0, s0, n2 < N, j2, 64, 8, 32, 4      # 64 bytes a 128-code block, per row; the second half 8 words on
    w0 = (j2 // 4).to(gl.int64) * (9 * N) + n2 * 8 + 4 * ((j2 // 2) % 2)
    s0 = (j2 // 4).to(gl.int64) * (9 * N) + 8 * N + n2
    return w0, s0, n2 < N, j2, 8 * 9 * N, 8 * 9 * N, 4 * 9 * N, 4 * 9 * N


@gluon.jit
def _block_words(base, s_base, w0, s0, m_n, j2, blk, w_step, s_step, w_h1, s_h1, n_words):
    """Both halves' words and scales of 128-block blk (_half's), in the register operand's layout."""
    wa, sa = _half(base, s_base, w0, s0, m_n, j2, blk, w_step, s_step, n_words, 0)
    wb, sb = _half(base, s_base, w0 + w_h1, s0 + s_h1, m_n, j2, blk, w_step, s_step, n_words, 1)
    return wa, sa, wb, sb


@gluon.jit
def _operands(wa, sa, wb, sb, PROBE: gl.constexpr = 0):
    """The eight register operands of a block, dot 4 H + q = pairs q of half H times their scales.
    PROBE (bench only, wrong numbers): 1 no words at all (a constant operand: x's ring and the MMAs alone);
    2 the words loaded and converted (one I2F a word) but not decoded; 3 as 1, and the epilogue stores nothing;
    4 as 1, and x never loaded (the ring's copies and waits gone: the MMAs, barriers and epilogue alone); 5 as 4, and
    the epilogue stores nothing (the MMAs and barriers alone)."""
    if PROBE == 1 or PROBE >= 3:
        one = gl.full(wa.shape, 1.0, gl.float16, layout=wa.type.layout)
        return one, one, one, one, one, one, one, one
    if PROBE == 2:
        ha = wa.to(gl.float16)
        hb = wb.to(gl.float16)
        return ha, ha, ha, ha, hb, hb, hb, hb
    fa = (sa.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 128.0).to(gl.float16)
    fb = (sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 128.0).to(gl.float16)
    p0, p1, p2, p3 = _pairs(wa)
    p4, p5, p6, p7 = _pairs(wb)
    return p0 * fa, p1 * fa, p2 * fa, p3 * fa, p4 * fb, p5 * fb, p6 * fb, p7 * fb


@gluon.jit
def _cat2(a, b, layout: gl.constexpr):
    """[R, C] and [R, C] -> [R, 2C] (a's columns, then b's) in `layout` (the register operand's, K = 2C)."""
    t = gl.permute(gl.join(a, b), (0, 2, 1))
    return gl.convert_layout(gl.reshape(t, (a.shape[0], 2 * a.shape[1])), layout)


@gluon.jit
def _up_store(acc, gs_ptr, g, h_ptr, n0, m0, m1, I, stride_hm, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              PROBE: gl.constexpr = 0, STORE: gl.constexpr = 1):
    """h[m, pos(n)] = relu(acc · global scale)² (fp16, 2^-8: the down's x, permuted as x is).
    STORE 1: acc's row r is already h's column n0 + r (LAYOUT 0), and the tile goes out in a layout of 8 columns a
    thread along h's rows (16-byte stores, a warp's two rows whole); 0 (bench only): from the MMA layout, a thread's
    pairs down h's columns at permuted_pos (2-byte stores, 16 sectors a warp for 64 bytes)."""
    b_h = gl.maximum(acc * (gl.load(gs_ptr + g) * 32768.0), 0.0)
    b_h = (b_h * b_h * (1.0 / 256.0)).to(gl.float16)
    if STORE == 1:
        lay: gl.constexpr = gl.BlockedLayout([8, 1], [BLOCK_N // 8, 256 // BLOCK_N], [1, gl.num_warps()], [0, 1])
        b_h = gl.convert_layout(b_h, lay)
    else:
        lay: gl.constexpr = acc.type.layout
    o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
    o_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, lay))
    m_row = o_m < m1
    if PROBE == 3 or PROBE == 5:
        m_row = m_row & (m1 < 0)
    if STORE == 1:              # every column of the tile is inside h's padded width; past I it holds zeros
        p_h = h_ptr + gl.expand_dims(o_m.to(gl.int64) * stride_hm, 0) + gl.expand_dims(o_n, 1)
        gl.store(p_h, b_h, mask=gl.expand_dims(m_row, 0))
    else:
        p_h = h_ptr + gl.expand_dims(o_m.to(gl.int64) * stride_hm, 0) + gl.expand_dims(permuted_pos(o_n), 1)
        gl.store(p_h, b_h, mask=gl.expand_dims(o_n < I, 1) & gl.expand_dims(m_row, 0))


@gluon.jit
def _down_store(acc, gs_ptr, g, w_ptr, tok_ptr, acc_ptr, n0, m0, m1, L, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, PROBE: gl.constexpr = 0, STORE: gl.constexpr = 1):
    """acc_ptr[tok[m], n] += acc · global scale · w[m] (the rows' routing weights). STORE 1: in a layout of four
    columns a thread along a token's row (one 16-byte vector atomic for four); 0 (bench only): from the MMA layout,
    one 4-byte atomic a value."""
    if STORE == 1:
        lay: gl.constexpr = gl.BlockedLayout([4, 1], [BLOCK_N // 4, 128 // BLOCK_N], [1, gl.num_warps()], [0, 1])
        b = gl.convert_layout(acc, lay)
    else:
        lay: gl.constexpr = acc.type.layout
        b = acc
    o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
    o_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, lay))
    m_m = o_m < m1
    if PROBE == 3 or PROBE == 5:
        m_m = m_m & (m1 < 0)
    b_y = b * (gl.load(gs_ptr + g) * 32768.0) * gl.expand_dims(gl.load(w_ptr + o_m, mask=m_m, other=0.0), 0)
    tok = gl.load(tok_ptr + o_m, mask=m_m, other=0)
    p = acc_ptr + gl.expand_dims(tok * L, 0) + gl.expand_dims(o_n, 1)
    gl.atomic_add(p, b_y, mask=gl.expand_dims(o_n < L, 1) & gl.expand_dims(m_m, 0), sem="relaxed")


@gluon.jit
def _tma_x(x_desc, m0, k0, bar, ring, stage, BLOCK_M: gl.constexpr):
    """Block k0 // 128 of x's rows m0 .. m0 + BLOCK_M into ring stage `stage` (two 64-column halves: a 128-byte
    swizzled TMA box holds 64 fp16), signalled on `bar`."""
    row = m0.to(gl.int32)
    mbarrier.expect(bar, 2 * BLOCK_M * 64 * 2)
    _tma_load(x_desc, [row, k0], bar, ring.index(2 * stage))
    _tma_load(x_desc, [row, k0 + 64], bar, ring.index(2 * stage + 1))


@gluon.jit
def _tma_start(base, s_base, n0, N, K, LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               PROBE: gl.constexpr, num_warps: gl.constexpr):
    """The TMA kernels' tile start: the accumulator (MMA layout), block 0's operands decoded, block 1's words on their
    way, and the words' offsets and steps (_word_offsets) with the count of words a row."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    w0, s0, m_n, j2, w_step, s_step, w_h1, s_h1 = _word_offsets(n0, N, K, LAYOUT, a_l, BLOCK_N)
    n_words = K // 8
    wa, sa, wb, sb = _block_words(base, s_base, w0, s0, m_n, j2, 0, w_step, s_step, w_h1, s_h1, n_words)
    ops = _operands(wa, sa, wb, sb, PROBE)
    words = _block_words(base, s_base, w0, s0, m_n, j2, 1, w_step, s_step, w_h1, s_h1, n_words)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    return acc, ops, words, (w0, s0, m_n, j2, w_step, s_step, w_h1, s_h1, n_words)


@gluon.jit
def _tma_block(a0, a1, a2, a3, a4, a5, a6, a7, ring, stage, acc, wa, sa, wb, sb, PROBE: gl.constexpr):
    """A block of the TMA kernels once its stage landed: each half block one K = 64 warpgroup_mma, the next block's
    operands decoded from (wa, sa, wb, sb) while they run, then the wait (both done). Returns acc and the next
    operands."""
    lay: gl.constexpr = a0.type.layout
    lo = _cat2(_cat2(a0, a1, lay), _cat2(a2, a3, lay), lay)
    acc = warpgroup_mma(lo, ring.index(2 * stage).permute((1, 0)), acc, is_async=True)
    hi = _cat2(_cat2(a4, a5, lay), _cat2(a6, a7, lay), lay)
    acc = warpgroup_mma(hi, ring.index(2 * stage + 1).permute((1, 0)), acc, is_async=True)
    b0, b1, b2, b3, b4, b5, b6, b7 = _operands(wa, sa, wb, sb, PROBE)
    acc, lo, hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc, lo, hi))
    return acc, b0, b1, b2, b3, b4, b5, b6, b7


@gluon.jit
def _rega_dot_t(x_desc, m0, base, s_base, n0, N, K, LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PROBE: gl.constexpr, num_warps: gl.constexpr):
    """_rega_dot_g at DEPTH 5 with x through TMA: a ring of STAGES blocks, each two [BLOCK_M, 64] boxes, one
    mbarrier a stage (its phase says which use of the stage landed), one CTA barrier a block (the stage about to
    be refilled is free in both warpgroups). No per-thread x addresses, no cp.async groups."""
    acc, ops, words, offs = _tma_start(base, s_base, n0, N, K, LAYOUT, BLOCK_M, BLOCK_N, PROBE, num_warps)
    a0, a1, a2, a3, a4, a5, a6, a7 = ops
    wa, sa, wb, sb = words
    w0, s0, m_n, j2, w_step, s_step, w_h1, s_h1, n_words = offs
    n_blocks = gl.cdiv(K, 128)
    ring = gl.allocate_shared_memory(gl.float16, [2 * STAGES, BLOCK_M, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for j in gl.static_range(STAGES - 1):
        if j < n_blocks and PROBE < 4:
            _tma_x(x_desc, m0, j * 128, bars.index(j), ring, j, BLOCK_M)

    for j in range(n_blocks):
        wa_next, sa_next, wb_next, sb_next = _block_words(base, s_base, w0, s0, m_n, j2, j + 2, w_step, s_step, w_h1,
                                                          s_h1, n_words)
        _barrier()                   # block j - 1's stage is read in both warpgroups: refill it
        if j + STAGES - 1 < n_blocks and PROBE < 4:
            r = (j + STAGES - 1) % STAGES
            _tma_x(x_desc, m0, (j + STAGES - 1) * 128, bars.index(r), ring, r, BLOCK_M)
        if PROBE < 4:
            mbarrier.wait(bars.index(j % STAGES), (j // STAGES) & 1)
        acc, a0, a1, a2, a3, a4, a5, a6, a7 = _tma_block(a0, a1, a2, a3, a4, a5, a6, a7, ring, j % STAGES, acc, wa,
                                                         sa, wb, sb, PROBE)
        wa, sa, wb, sb = wa_next, sa_next, wb_next, sb_next
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    return acc


# the tile count and the table (a slice of the launch-table ring at any word) change with every launch, w and tok are
# slices of the sorted rows at any row: one compile for all (kernels/backend.py `varying`), not one per value class
@gluon.jit(**varying("table_ptr", "n_tiles"))
def _rega_up_kernel_t(x_desc, table_ptr, gs_ptr, h_ptr, n_tiles, I, L, stride_hm, up_scales_off,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr, PROBE: gl.constexpr = 0, STORE: gl.constexpr = 1):
    g, m0, m1, base = tile_entry(table_ptr, gl.program_id(1), n_tiles)
    n0 = gl.program_id(0) * BLOCK_N
    acc = _rega_dot_t(x_desc, m0, base, base + up_scales_off, n0, I, L, 2 - 2 * STORE, BLOCK_M, BLOCK_N, STAGES,
                      PROBE, num_warps)
    _up_store(acc, gs_ptr, g, h_ptr, n0, m0, m1, I, stride_hm, BLOCK_M, BLOCK_N, PROBE, STORE)


@gluon.jit(**varying("table_ptr", "n_tiles", "w_ptr", "tok_ptr"))
def _rega_down_kernel_t(h_desc, table_ptr, gs_ptr, w_ptr, tok_ptr, acc_ptr, n_tiles, L, I, down_off,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        num_warps: gl.constexpr, PROBE: gl.constexpr = 0, STORE: gl.constexpr = 1):
    g, m0, m1, base = tile_entry(table_ptr, gl.program_id(1), n_tiles)
    base += down_off
    n0 = gl.program_id(0) * BLOCK_N
    acc = _rega_dot_t(h_desc, m0, base, base, n0, L, I, 1, BLOCK_M, BLOCK_N, STAGES, PROBE, num_warps)
    _down_store(acc, gs_ptr, g, w_ptr, tok_ptr, acc_ptr, n0, m0, m1, L, BLOCK_M, BLOCK_N, PROBE, STORE)


def launch_tma(tab, n, lo, hi, xp, h, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg: dict,
               part: str = "both", down_tab=None, down_off: int | None = None, **flags):
    """The up and the down over `prepare`'s launch (tab: the tile table and block addresses; n tiles; rows lo .. hi;
    xp the rows' permuted fp16 x; h the up's output, padded I wide). up/down_global: the global scales in the
    launch's expert order. cfg: BLOCK_M, BLOCK_N, STAGES, num_warps. down_tab / down_off: the down's table and the
    down section's offset in each block (a split store's regrouped sections: their own addresses, offset 0); None:
    `tab` and geom.down_off. part (bench only): "up" or "down" alone. flags (bench only): PROBE, STORE."""
    L, I = geom.L, geom.I
    launch = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "STAGES", "num_warps")}
    launch.update(flags)
    box = [cfg["BLOCK_M"], 64]
    if part != "down":
        x_desc = TensorDescriptor.from_tensor(xp, box, x_layout(cfg["BLOCK_M"]))
        _rega_up_kernel_t[(triton.cdiv(I, cfg["BLOCK_N"]), n)](x_desc, tab, up_global, h, n, I, L, h.stride(0),
                                                                geom.up_scales_off, **launch)
    if part != "up":
        h_desc = TensorDescriptor.from_tensor(h, box, x_layout(cfg["BLOCK_M"]))
        _rega_down_kernel_t[(triton.cdiv(L, cfg["BLOCK_N"]), n)](
            h_desc, tab if down_tab is None else down_tab, down_global, w_sorted[lo:hi], tok_sorted[lo:hi], acc, n,
            L, I, geom.down_off if down_off is None else down_off, **launch)
    return acc
