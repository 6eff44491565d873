"""`rega` written in Gluon (Triton's explicit-layout dialect, sm_90 only, Triton 3.6's API: the device's): the same
permuted-x scheme as kernels/expert_prefill_rega.py, with the layouts that scheme needs stated instead of hoped for.
The variants measured on the way (bench/NOTES.md, sessions 37-40) and the parts table; the winner (TMA, DEPTH 5,
256-row tiles) and the helpers every variant shares are the engine's, in kernels/expert_prefill_rega_gluon.py,
imported here (compile_offline and the parts table find its kernels by their names).

Triton's own compiler keeps the code words in a blocked layout and converts every decoded nibble tile to wgmma's
register operand through shared memory (STS + LDSM.MT per tile, a barrier and a wgmma wait per dot: ~11
instructions a weight, SASS sm_90). Here the words are loaded straight into the register operand's layout
(DotOperandLayout of the MMA, k_width 2): lane c of a quad gets words p = c and c + 4 of each row and half block
(each twice: the two columns of its pair), DECODE_PTX turns each word into the pairs (q, q + 4) of four dots, the
scale is multiplied in fp16, and each K = 16 operand goes to `warpgroup_mma` as it is. x goes through a ring of
shared-memory stages filled by cp.async (the only operand in shared memory); the words of the next block are loaded
into registers while a block is multiplied.

DEPTH, how the dots are issued (bench/NOTES.md, session 37): 1 two in flight (each dot waits for the one before the
last), 3 four in flight, 4 four in flight and the next block's operands decoded under this block's last dots, 5 as 4
with each half block one K = 64 warpgroup_mma (one wgmma fence for four dots), 6 as 4 with the block one K = 128
warpgroup_mma. Session 37 measured only the first version (DEPTH 1's waits): right, 1.8-2.3x the engine's path at 64
rows an expert, flat at ~215 TFLOP/s from 256 rows on (25-28 % of the bf16 GEMM); 3-6 are compiled and unmeasured.
Two more ways (session 38): TMA=True reads x through TMA boxes and mbarriers (DEPTH 5's order, `_rega_dot_t`);
MMA=2 runs the same words and decode on mma.sync (`_rega_dot_v2`: sm_80 and later, the consumer cards' instruction,
whose A fragment is wgmma's), x from the ring into B fragments per dot.
PROBE and PART (bench only) take the decode or the words out and time the up or the down alone (`parts`).
No interpreter path: Gluon kernels run on a GPU only. The CPU tests run the Triton twin (same permutation, same
numbers) and compile these kernels for sm_90 / sm_120 with the installed Triton (`compile_offline`); the GPU test
compares this kernel to the layer's reference.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.expert_prefill_rega import prepare, tile_entry
# the engine's kernels (the winner, session 40) and the helpers every variant here shares
from kernels.expert_prefill_rega_gluon import (_barrier, _block_words, _cat2, _down_store, _operands,  # noqa: F401
                                               _rega_down_kernel_t, _rega_up_kernel_t, _tma_block, _tma_start, _tma_x,
                                               _up_store, _word_offsets, launch_tma, x_layout)

# Gluon renamed its copies after 3.6 (the device's): 3.9's `async_load` is 3.6's `async_copy_global_to_shared`, which
# 3.9 keeps only as a stub that raises
_cp_load = cp.async_load if hasattr(cp, "async_load") else cp.async_copy_global_to_shared

GLUON_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=3, num_warps=8)



@gluon.jit
def _load_x(x_ptr, x_offs, x_mask, ring, stage, k0):
    _cp_load(ring.index(stage), x_ptr + (x_offs + k0), mask=x_mask)
    cp.commit_group()


@gluon.jit
def _ring_step(x_ptr, x_offs, x_mask, ring, j, n_blocks, STAGES: gl.constexpr, PROBE: gl.constexpr = 0):
    """Block j of the cp.async ring: block j + STAGES - 1 sent on its way (an empty group past the end keeps the count
    of groups in flight), and this thread's copies of block j landed (the CTA barrier after it is the caller's).
    PROBE 4 (bench only): no copies and no wait (the MMAs read whatever the ring holds)."""
    if PROBE < 4:
        _refill(x_ptr, x_offs, x_mask, ring, j + STAGES - 1, n_blocks, STAGES)
        cp.wait_group(STAGES - 1)


@gluon.jit
def _refill(x_ptr, x_offs, x_mask, ring, b, n_blocks, STAGES: gl.constexpr):
    """Block b of x into ring stage b % STAGES, or an empty group past the end (the count of groups in flight)."""
    if b < n_blocks:
        _load_x(x_ptr, x_offs, x_mask, ring, b % STAGES, b * 128)
    else:
        cp.commit_group()


@gluon.jit
def _stage_ready(FENCE: gl.constexpr):
    """After the ring's wait: every thread's copies of the stage visible to every warp (and to wgmma's async proxy
    through the fence; FENCE 0, bench only, leaves the fence out)."""
    if FENCE:
        fence_async_shared()
    _barrier()


@gluon.jit
def _x_ring(x_ptr, stride_xm, m0, m1, K, x_l: gl.constexpr, x_s: gl.constexpr, BLOCK_M: gl.constexpr,
            STAGES: gl.constexpr, PROBE: gl.constexpr = 0):
    """x's rows m0 .. m0 + BLOCK_M (permuted fp16), 128 columns a block, through a ring of STAGES shared-memory
    stages in layout x_s filled by cp.async: the ring with its first STAGES - 1 blocks on their way, the threads'
    addresses and row mask (layout x_l), and the number of blocks."""
    o_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_l))
    o_c = gl.arange(0, 128, layout=gl.SliceLayout(0, x_l))
    x_offs = gl.expand_dims(o_m.to(gl.int64) * stride_xm, 1) + gl.expand_dims(o_c, 0)
    x_mask = gl.expand_dims(o_m < m1, 1) & gl.expand_dims(o_c >= 0, 0)
    ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, 128], x_s)
    n_blocks = gl.cdiv(K, 128)
    if PROBE < 4:
        for j in gl.static_range(STAGES - 1):
            _refill(x_ptr, x_offs, x_mask, ring, j, n_blocks, STAGES)
    return ring, x_offs, x_mask, n_blocks


@gluon.jit
def _dot(a, tile, d: gl.constexpr, acc):
    return warpgroup_mma(a, tile.slice(16 * d, 16, dim=1).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _mma_block(wa, sa, wb, sb, tile, acc, DEPTH: gl.constexpr, PROBE: gl.constexpr):
    """The block's eight dots issued back to back. DEPTH 1: each dot waits for the one before the last (two in
    flight); DEPTH 3: four in flight, an operand released when the wait after the dot three on says it was read.
    (DEPTH 4 is _rega_dot_g's pipelined loop.)"""
    a0, a1, a2, a3, a4, a5, a6, a7 = _operands(wa, sa, wb, sb, PROBE)
    if DEPTH == 1:
        acc = _dot(a0, tile, 0, acc)
        acc = _dot(a1, tile, 1, acc)
        acc, a0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a0))
        acc = _dot(a2, tile, 2, acc)
        acc, a1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a1))
        acc = _dot(a3, tile, 3, acc)
        acc, a2 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a2))
        acc = _dot(a4, tile, 4, acc)
        acc, a3 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a3))
        acc = _dot(a5, tile, 5, acc)
        acc, a4 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a4))
        acc = _dot(a6, tile, 6, acc)
        acc, a5 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a5))
        acc = _dot(a7, tile, 7, acc)
        acc, a6 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a6))
    else:
        acc, a5, a6, a7 = _issue_block(a0, a1, a2, a3, a4, a5, a6, a7, tile, acc)
        acc, a5, a6 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a5, a6))
    acc, a7 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a7))
    return acc


@gluon.jit
def _issue_halves(a0, a1, a2, a3, a4, a5, a6, a7, tile, acc):
    """DEPTH 5: each half block one warpgroup_mma of K = 64 (four wgmma in one group, as a plain GEMM's K step),
    the operand built from its four K = 16 pieces; returns with the second half in flight."""
    lay: gl.constexpr = a0.type.layout
    lo = _cat2(_cat2(a0, a1, lay), _cat2(a2, a3, lay), lay)
    acc = warpgroup_mma(lo, tile.slice(0, 64, dim=1).permute((1, 0)), acc, is_async=True)
    hi = _cat2(_cat2(a4, a5, lay), _cat2(a6, a7, lay), lay)
    acc = warpgroup_mma(hi, tile.slice(64, 64, dim=1).permute((1, 0)), acc, is_async=True)
    acc, lo = warpgroup_mma_wait(num_outstanding=1, deps=(acc, lo))
    return acc, hi


@gluon.jit
def _whole(a0, a1, a2, a3, a4, a5, a6, a7):
    """The block's eight K = 16 operands as one K = 128 register operand (a register-only conversion)."""
    lay: gl.constexpr = a0.type.layout
    return _cat2(_cat2(_cat2(a0, a1, lay), _cat2(a2, a3, lay), lay), _cat2(_cat2(a4, a5, lay), _cat2(a6, a7, lay), lay),
                 lay)


@gluon.jit
def _issue_whole(a0, a1, a2, a3, a4, a5, a6, a7, tile, acc):
    """DEPTH 6: the block's eight dots as one K = 128 warpgroup_mma (one fence, eight wgmma in one group)."""
    a = _whole(a0, a1, a2, a3, a4, a5, a6, a7)
    acc = warpgroup_mma(a, tile.permute((1, 0)), acc, is_async=True)
    return acc, a


@gluon.jit
def _issue_block(a0, a1, a2, a3, a4, a5, a6, a7, tile, acc):
    """DEPTH 3's issue order without the final drain: returns with dots 5-7 in flight (their operands still held)."""
    acc = _dot(a0, tile, 0, acc)
    acc = _dot(a1, tile, 1, acc)
    acc = _dot(a2, tile, 2, acc)
    acc = _dot(a3, tile, 3, acc)
    acc, a0 = warpgroup_mma_wait(num_outstanding=3, deps=(acc, a0))
    acc = _dot(a4, tile, 4, acc)
    acc, a1 = warpgroup_mma_wait(num_outstanding=3, deps=(acc, a1))
    acc = _dot(a5, tile, 5, acc)
    acc, a2 = warpgroup_mma_wait(num_outstanding=3, deps=(acc, a2))
    acc = _dot(a6, tile, 6, acc)
    acc, a3 = warpgroup_mma_wait(num_outstanding=3, deps=(acc, a3))
    acc = _dot(a7, tile, 7, acc)
    acc, a4 = warpgroup_mma_wait(num_outstanding=3, deps=(acc, a4))
    return acc, a5, a6, a7


@gluon.jit
def _async_block(ring, j, a, acc, STAGES: gl.constexpr, PROBE: gl.constexpr, FENCE: gl.constexpr):
    """DEPTH 7: block j's K = 128 wgmma on its way once x's block j landed (blocks j + 1 .. j + STAGES - 2 may still
    be on theirs)."""
    if PROBE < 4:
        cp.wait_group(STAGES - 2)
    _stage_ready(FENCE)
    return warpgroup_mma(a, ring.index(j % STAGES).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _pipelined(x_ptr, x_offs, x_mask, ring, n_blocks, acc, wa, sa, wb, sb, base, s_base, w0, s0, m_n, j2, w_step,
               s_step, w_h1, s_h1, n_words, STAGES: gl.constexpr, PROBE: gl.constexpr, FENCE: gl.constexpr):
    """DEPTH 7: a plain GEMM's pipeline (Triton's own): block j's K = 128 wgmma stays in flight while block j + 1 is
    decoded; the wait that proves block j - 1 done (wait <= 1) frees its ring stage, refilled with block
    j + STAGES - 1 after one CTA barrier, and its register operand. No drain inside the loop.
    The loop runs two blocks a trip, even blocks' operand in one set of registers and odd blocks' in another, each
    decoded only after the wait that frees it: an operand carried round the loop in one set (a move at the loop's
    end while its wgmma is still reading it) gave wrong sums at STAGES 3 (session 40; PTX leaves that undefined).
    The words (not the 8-bit scales: the wait takes no 8-bit values) reach the decode through the wait, so the
    operand is not written above it."""
    even = _whole(*_operands(wa, sa, wb, sb, PROBE))                                  # block 0
    wa, sa, wb, sb = _block_words(base, s_base, w0, s0, m_n, j2, 1, w_step, s_step, w_h1, s_h1, n_words)
    for jj in range(n_blocks // 2):
        j = 2 * jj
        ea, esa, eb, esb = _block_words(base, s_base, w0, s0, m_n, j2, j + 2, w_step, s_step, w_h1, s_h1, n_words)
        acc = _async_block(ring, j, even, acc, STAGES, PROBE, FENCE)
        acc, wa, wb = warpgroup_mma_wait(num_outstanding=1, deps=(acc, wa, wb))   # block j - 1 done
        _barrier()                             # block j - 1's stage read in both warpgroups: refill it
        if PROBE < 4:
            _refill(x_ptr, x_offs, x_mask, ring, j + STAGES - 1, n_blocks, STAGES)
        odd = _whole(*_operands(wa, sa, wb, sb, PROBE))                               # block j + 1
        wa, sa, wb, sb = _block_words(base, s_base, w0, s0, m_n, j2, j + 3, w_step, s_step, w_h1, s_h1, n_words)
        acc = _async_block(ring, j + 1, odd, acc, STAGES, PROBE, FENCE)
        acc, even, ea, eb = warpgroup_mma_wait(num_outstanding=1, deps=(acc, even, ea, eb))
        _barrier()                             # block j done
        if PROBE < 4:
            _refill(x_ptr, x_offs, x_mask, ring, j + STAGES, n_blocks, STAGES)
        even = _whole(*_operands(ea, esa, eb, esb, PROBE))                            # block j + 2
    if n_blocks % 2 == 1:                      # the last block, even
        acc = _async_block(ring, n_blocks - 1, even, acc, STAGES, PROBE, FENCE)
        acc, even = warpgroup_mma_wait(num_outstanding=0, deps=(acc, even))
    acc, even = warpgroup_mma_wait(num_outstanding=0, deps=(acc, even))
    return acc


@gluon.jit
def _rega_dot_g(x_ptr, stride_xm, m0, m1, base, s_base, n0, N, K, LAYOUT: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DEPTH: gl.constexpr,
                PROBE: gl.constexpr, FENCE: gl.constexpr, num_warps: gl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (MMA layout) = sum over K of W[n0 + r, k] x[m0 + c, k] · 2^-15, x permuted fp16.
    FENCE 0 (bench): no proxy fence between the ring's cp.async and the wgmma that reads it (ptxas makes the fence a
    MEMBAR.ALL.CTA as well; Triton's own cp.async pipelines have none)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    x_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 128], gl.float16)

    w0, s0, m_n, j2, w_step, s_step, w_h1, s_h1 = _word_offsets(n0, N, K, LAYOUT, a_l, BLOCK_N)
    n_words = K // 8

    ring, x_offs, x_mask, n_blocks = _x_ring(x_ptr, stride_xm, m0, m1, K, x_l, x_s, BLOCK_M, STAGES, PROBE)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    wa, sa, wb, sb = _block_words(base, s_base, w0, s0, m_n, j2, 0, w_step, s_step, w_h1, s_h1, n_words)
    if DEPTH == 7:
        return _pipelined(x_ptr, x_offs, x_mask, ring, n_blocks, acc, wa, sa, wb, sb, base, s_base, w0, s0, m_n, j2,
                          w_step, s_step, w_h1, s_h1, n_words, STAGES, PROBE, FENCE)
    if DEPTH >= 4:
        # DEPTH 4: DEPTH 3's order, and the next block's operands decoded while this block's last dots run;
        # DEPTH 5: the same with a half block's four dots as one K = 64 warpgroup_mma; DEPTH 6: the whole block as
        # one K = 128 warpgroup_mma
        a0, a1, a2, a3, a4, a5, a6, a7 = _operands(wa, sa, wb, sb, PROBE)
        wa, sa, wb, sb = _block_words(base, s_base, w0, s0, m_n, j2, 1, w_step, s_step, w_h1, s_h1, n_words)
        for j in range(n_blocks):
            wa_next, sa_next, wb_next, sb_next = _block_words(base, s_base, w0, s0, m_n, j2, j + 2, w_step, s_step,
                                                              w_h1, s_h1, n_words)
            _ring_step(x_ptr, x_offs, x_mask, ring, j, n_blocks, STAGES, PROBE)
            _stage_ready(FENCE)
            if DEPTH == 4:
                acc, a5, a6, a7 = _issue_block(a0, a1, a2, a3, a4, a5, a6, a7, ring.index(j % STAGES), acc)
                b0, b1, b2, b3, b4, b5, b6, b7 = _operands(wa, sa, wb, sb, PROBE)
                acc, a5, a6, a7 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a5, a6, a7))
            elif DEPTH == 5:
                acc, hi = _issue_halves(a0, a1, a2, a3, a4, a5, a6, a7, ring.index(j % STAGES), acc)
                b0, b1, b2, b3, b4, b5, b6, b7 = _operands(wa, sa, wb, sb, PROBE)
                acc, hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc, hi))
            else:
                acc, whole = _issue_whole(a0, a1, a2, a3, a4, a5, a6, a7, ring.index(j % STAGES), acc)
                b0, b1, b2, b3, b4, b5, b6, b7 = _operands(wa, sa, wb, sb, PROBE)
                acc, whole = warpgroup_mma_wait(num_outstanding=0, deps=(acc, whole))
            _barrier()
            a0, a1, a2, a3, a4, a5, a6, a7 = b0, b1, b2, b3, b4, b5, b6, b7
            wa, sa, wb, sb = wa_next, sa_next, wb_next, sb_next
        return acc
    for j in range(n_blocks):
        # the next block's words and scales, ahead of this block's MMAs
        wa_next, sa_next, wb_next, sb_next = _block_words(base, s_base, w0, s0, m_n, j2, j + 1, w_step, s_step, w_h1,
                                                          s_h1, n_words)
        _ring_step(x_ptr, x_offs, x_mask, ring, j, n_blocks, STAGES, PROBE)
        _stage_ready(FENCE)
        tile = ring.index(j % STAGES)
        acc = _mma_block(wa, sa, wb, sb, tile, acc, DEPTH, PROBE)
        _barrier()                             # every warp is done with this stage before it is refilled
        wa = wa_next
        sa = sa_next
        wb = wb_next
        sb = sb_next
    return acc


@gluon.jit
def _seq_fill(x_desc, table_ptr, n_n, total, n_blocks, G, ring, bars, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """PERSIST: block G of this CTA's sequence (its tiles program_id, + num_programs, ...; n_blocks each) into ring
    stage G % STAGES, if that tile exists. The sequence runs across tiles, so the next tile's first blocks are on their
    way while this tile's last blocks and its epilogue run."""
    t = gl.program_id(0) + (G // n_blocks) * gl.num_programs(0)
    if t < total:
        m0 = gl.load(table_ptr + 3 * (t // n_n) + 1)
        _tma_x(x_desc, m0, (G % n_blocks) * 128, bars.index(G % STAGES), ring, G % STAGES, BLOCK_M)


@gluon.jit
def _seq_ring(x_desc, table_ptr, n_n, total, n_blocks, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
              PROBE: gl.constexpr):
    """PERSIST: the ring (two [BLOCK_M, 64] boxes a stage, one mbarrier a stage) with the sequence's first
    STAGES - 1 blocks on their way."""
    ring = gl.allocate_shared_memory(gl.float16, [2 * STAGES, BLOCK_M, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    if PROBE < 4:
        for g in gl.static_range(STAGES - 1):
            _seq_fill(x_desc, table_ptr, n_n, total, n_blocks, g, ring, bars, BLOCK_M, STAGES)
    return ring, bars


@gluon.jit
def _rega_dot_p(x_desc, table_ptr, n_n, total, ring, bars, g0, base, s_base, n0, N, K, LAYOUT: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PROBE: gl.constexpr,
                num_warps: gl.constexpr):
    """_rega_dot_t for one tile of a persistent CTA's sequence: its blocks are g0 .. g0 + n_blocks of the sequence,
    and each step refills the ring with the sequence's block STAGES - 1 ahead, which past the tile's end is the CTA's
    next tile's (its phase and stage from the sequence's position)."""
    acc, ops, words, offs = _tma_start(base, s_base, n0, N, K, LAYOUT, BLOCK_M, BLOCK_N, PROBE, num_warps)
    a0, a1, a2, a3, a4, a5, a6, a7 = ops
    wa, sa, wb, sb = words
    w0, s0, m_n, j2, w_step, s_step, w_h1, s_h1, n_words = offs
    n_blocks = gl.cdiv(K, 128)
    for j in range(n_blocks):
        wa_next, sa_next, wb_next, sb_next = _block_words(base, s_base, w0, s0, m_n, j2, j + 2, w_step, s_step, w_h1,
                                                          s_h1, n_words)
        _barrier()                   # the sequence's block before is read in both warpgroups: refill its stage
        g = g0 + j
        if PROBE < 4:
            _seq_fill(x_desc, table_ptr, n_n, total, n_blocks, g + STAGES - 1, ring, bars, BLOCK_M, STAGES)
            mbarrier.wait(bars.index(g % STAGES), (g // STAGES) & 1)
        acc, a0, a1, a2, a3, a4, a5, a6, a7 = _tma_block(a0, a1, a2, a3, a4, a5, a6, a7, ring, g % STAGES, acc, wa,
                                                         sa, wb, sb, PROBE)
        wa, sa, wb, sb = wa_next, sa_next, wb_next, sb_next
    return acc


@gluon.jit
def _seq_tiles(x_desc, table_ptr, gs_ptr, n_tiles, N, K, w_off, s_off, LAYOUT: gl.constexpr, h_ptr, stride_hm, w_ptr,
               tok_ptr, acc_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               PROBE: gl.constexpr, num_warps: gl.constexpr):
    """PERSIST's kernels' body: tiles program_id, + num_programs, ... (N tiles fastest, the tile kernels' grid
    order), one CTA an SM, x's ring running on across its tiles; LAYOUT 0 the up's epilogue (h_ptr, stride_hm), 1 the
    down's (w_ptr, tok_ptr, acc_ptr). Session 40: 7-16 points below the tile kernels (bench/NOTES.md)."""
    n_n = gl.cdiv(N, BLOCK_N)
    total = n_n * n_tiles
    n_blocks = gl.cdiv(K, 128)
    ring, bars = _seq_ring(x_desc, table_ptr, n_n, total, n_blocks, BLOCK_M, STAGES, PROBE)
    g0 = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        g, m0, m1, base = tile_entry(table_ptr, t // n_n, n_tiles)
        n0 = (t % n_n) * BLOCK_N
        acc = _rega_dot_p(x_desc, table_ptr, n_n, total, ring, bars, g0, base + w_off, base + s_off, n0, N, K,
                          LAYOUT, BLOCK_M, BLOCK_N, STAGES, PROBE, num_warps)
        g0 += n_blocks
        if LAYOUT == 0:
            _up_store(acc, gs_ptr, g, h_ptr, n0, m0, m1, N, stride_hm, BLOCK_M, BLOCK_N, PROBE, 1)
        else:
            _down_store(acc, gs_ptr, g, w_ptr, tok_ptr, acc_ptr, n0, m0, m1, N, BLOCK_M, BLOCK_N, PROBE, 1)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


@gluon.jit
def _rega_up_kernel_p(x_desc, table_ptr, gs_ptr, h_ptr, n_tiles, I, L, stride_hm, up_scales_off,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr, PROBE: gl.constexpr = 0):
    _seq_tiles(x_desc, table_ptr, gs_ptr, n_tiles, I, L, 0, up_scales_off, 0, h_ptr, stride_hm, h_ptr, h_ptr, h_ptr,
               BLOCK_M, BLOCK_N, STAGES, PROBE, num_warps)


@gluon.jit
def _rega_down_kernel_p(h_desc, table_ptr, gs_ptr, w_ptr, tok_ptr, acc_ptr, n_tiles, L, I, down_off,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        num_warps: gl.constexpr, PROBE: gl.constexpr = 0):
    _seq_tiles(h_desc, table_ptr, gs_ptr, n_tiles, L, I, down_off, down_off, 1, w_ptr, 0, w_ptr, tok_ptr, acc_ptr,
               BLOCK_M, BLOCK_N, STAGES, PROBE, num_warps)


@gluon.jit
def _rega_dot_v2(x_ptr, stride_xm, m0, m1, base, s_base, n0, N, K, LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WARPS_N: gl.constexpr, PROBE: gl.constexpr,
                 num_warps: gl.constexpr):
    """_rega_dot_g on mma.sync (mma_v2: sm_80 and later, the consumer cards' instruction; wgmma is sm_90 only).
    Its A fragment is wgmma's (k_width 2: lane c of a quad holds the column pairs c and c + 4), so the words and
    their decode are the same; x goes from the cp.async ring into B fragments (ldmatrix) per dot. The warps tile
    the accumulator [num_warps // WARPS_N, WARPS_N]: WARPS_N > 1 decodes each weight in WARPS_N warps and reads
    each x fragment in fewer."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps // WARPS_N, WARPS_N],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    x_s: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    w0, s0, m_n, j2, w_step, s_step, w_h1, s_h1 = _word_offsets(n0, N, K, LAYOUT, a_l, BLOCK_N)
    n_words = K // 8
    ring, x_offs, x_mask, n_blocks = _x_ring(x_ptr, stride_xm, m0, m1, K, x_l, x_s, BLOCK_M, STAGES, PROBE)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    wa, sa, wb, sb = _block_words(base, s_base, w0, s0, m_n, j2, 0, w_step, s_step, w_h1, s_h1, n_words)
    for j in range(n_blocks):
        wa_next, sa_next, wb_next, sb_next = _block_words(base, s_base, w0, s0, m_n, j2, j + 1, w_step, s_step, w_h1,
                                                          s_h1, n_words)
        _ring_step(x_ptr, x_offs, x_mask, ring, j, n_blocks, STAGES, PROBE)
        _barrier()
        tile = ring.index(j % STAGES)
        a0, a1, a2, a3, a4, a5, a6, a7 = _operands(wa, sa, wb, sb, PROBE)
        acc = mma_v2(a0, tile.slice(0, 16, dim=1).permute((1, 0)).load(b_l), acc)
        acc = mma_v2(a1, tile.slice(16, 16, dim=1).permute((1, 0)).load(b_l), acc)
        acc = mma_v2(a2, tile.slice(32, 16, dim=1).permute((1, 0)).load(b_l), acc)
        acc = mma_v2(a3, tile.slice(48, 16, dim=1).permute((1, 0)).load(b_l), acc)
        acc = mma_v2(a4, tile.slice(64, 16, dim=1).permute((1, 0)).load(b_l), acc)
        acc = mma_v2(a5, tile.slice(80, 16, dim=1).permute((1, 0)).load(b_l), acc)
        acc = mma_v2(a6, tile.slice(96, 16, dim=1).permute((1, 0)).load(b_l), acc)
        acc = mma_v2(a7, tile.slice(112, 16, dim=1).permute((1, 0)).load(b_l), acc)
        _barrier()                             # every warp is done with this stage before it is refilled
        wa, sa, wb, sb = wa_next, sa_next, wb_next, sb_next
    return acc


@gluon.jit
def _rega_dot(x_ptr, stride_xm, m0, m1, base, s_base, n0, N, K, LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DEPTH: gl.constexpr, MMA: gl.constexpr,
              WARPS_N: gl.constexpr, PROBE: gl.constexpr, FENCE: gl.constexpr, num_warps: gl.constexpr):
    """The cp.async ring's kernels' dot: wgmma (MMA 3, _rega_dot_g at DEPTH) or mma.sync (MMA 2, _rega_dot_v2 with
    WARPS_N); MMA is a constexpr, so one of the two is compiled."""
    if MMA == 2:
        acc = _rega_dot_v2(x_ptr, stride_xm, m0, m1, base, s_base, n0, N, K, LAYOUT, BLOCK_M, BLOCK_N, STAGES, WARPS_N,
                           PROBE, num_warps)
    else:
        acc = _rega_dot_g(x_ptr, stride_xm, m0, m1, base, s_base, n0, N, K, LAYOUT, BLOCK_M, BLOCK_N, STAGES, DEPTH,
                          PROBE, FENCE, num_warps)
    return acc


@gluon.jit
def _rega_up_kernel_g(x_ptr, table_ptr, gs_ptr, h_ptr, n_tiles, I, L, stride_xm, stride_hm, up_scales_off,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      DEPTH: gl.constexpr, num_warps: gl.constexpr, PROBE: gl.constexpr = 0,
                      FENCE: gl.constexpr = 1, MMA: gl.constexpr = 3, WARPS_N: gl.constexpr = 1,
                      STORE: gl.constexpr = 1):
    g, m0, m1, base = tile_entry(table_ptr, gl.program_id(1), n_tiles)
    n0 = gl.program_id(0) * BLOCK_N
    acc = _rega_dot(x_ptr, stride_xm, m0, m1, base, base + up_scales_off, n0, I, L, 2 - 2 * STORE, BLOCK_M,
                    BLOCK_N, STAGES, DEPTH, MMA, WARPS_N, PROBE, FENCE, num_warps)
    _up_store(acc, gs_ptr, g, h_ptr, n0, m0, m1, I, stride_hm, BLOCK_M, BLOCK_N, PROBE, STORE)


@gluon.jit
def _rega_down_kernel_g(h_ptr, table_ptr, gs_ptr, w_ptr, tok_ptr, acc_ptr, n_tiles, L, I, stride_hm, down_off,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        DEPTH: gl.constexpr, num_warps: gl.constexpr, PROBE: gl.constexpr = 0,
                        FENCE: gl.constexpr = 1, MMA: gl.constexpr = 3, WARPS_N: gl.constexpr = 1,
                        STORE: gl.constexpr = 1):
    g, m0, m1, base = tile_entry(table_ptr, gl.program_id(1), n_tiles)
    base += down_off
    n0 = gl.program_id(0) * BLOCK_N
    acc = _rega_dot(h_ptr, stride_hm, m0, m1, base, base, n0, L, I, 1, BLOCK_M, BLOCK_N, STAGES, DEPTH, MMA, WARPS_N,
                    PROBE, FENCE, num_warps)
    _down_store(acc, gs_ptr, g, w_ptr, tok_ptr, acc_ptr, n0, m0, m1, L, BLOCK_M, BLOCK_N, PROBE, STORE)


def rega_gluon(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, config=None,
               prepared=None):
    """As bench.kernels.expert_prefill_rega.rega, the kernels in Gluon (sm_90; MMA 2: sm_80 and later).
    prepared: `prepare`'s result for these rows and the config's BLOCK_M, made once (the parts table times the
    kernels alone; the sweep times the whole path, the table and x's permutation included)."""
    cfg = {**GLUON_CONFIG, **(config or {})}
    got = prepared if prepared is not None else prepare(x_sorted, segments, addrs, geom, cfg["BLOCK_M"])
    if got is None:
        return acc
    tab, n, lo, hi, xp, h = got
    L, I = geom.L, geom.I
    if cfg.get("TMA"):
        return _rega_tma(xp, tab, n, lo, hi, h, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg)
    up, down = _rega_up_kernel_g, _rega_down_kernel_g
    launch = _launch_args(cfg, "DEPTH", *(k for k in ("MMA", "WARPS_N") if k in cfg))
    part = cfg.get("PART", "both")      # bench only: "up" / "down" alone (the down then reads h as it is)
    if part != "down":
        up[(triton.cdiv(I, cfg["BLOCK_N"]), n)](xp, tab, up_global, h, n, I, L, xp.stride(0), h.stride(0),
                                                geom.up_scales_off, **launch)
    if part != "up":
        down[(triton.cdiv(L, cfg["BLOCK_N"]), n)](h, tab, down_global, w_sorted[lo:hi], tok_sorted[lo:hi], acc, n, L,
                                                  I, h.stride(0), geom.down_off, **launch)
    return acc


def _launch_args(cfg: dict, *extra: str) -> dict:
    """A config's launch keywords: the tiles, the ring, the warps, the kernel's own keys, and PROBE (bench only: the
    probes' wrong numbers, see _operands) and FENCE (bench only: 0 drops the cp.async ring's proxy fence) when set."""
    launch = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "STAGES", *extra, "num_warps")}
    launch.update({k: cfg[k] for k in ("PROBE", "FENCE", "STORE") if k in cfg})
    return launch


def _rega_tma(xp, tab, n, lo, hi, h, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg):
    """rega_gluon's launches with x (and h) read through TMA descriptors (config TMA: DEPTH 5's issue order, the
    engine's `launch_tma`; PERSIST: one CTA an SM over its share of the tiles, x's ring running on across them)."""
    L, I = geom.L, geom.I
    part = cfg.get("PART", "both")
    if not cfg.get("PERSIST"):
        flags = {k: cfg[k] for k in ("PROBE", "STORE") if k in cfg}
        return launch_tma(tab, n, lo, hi, xp, h, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg, part,
                          **flags)
    if cfg.get("STORE", 1) != 1:
        raise ValueError("PERSIST runs the coalesced epilogue only (STORE 1)")
    launch = _launch_args(cfg)
    launch.pop("STORE", None)
    box = [cfg["BLOCK_M"], 64]
    # PERSIST True: as many CTAs as SMs (or a tile each, if fewer); a number: that many (the tests: several tiles a
    # CTA on a small layer)
    ctas = torch.cuda.get_device_properties(xp.device).multi_processor_count if cfg["PERSIST"] is True \
        else int(cfg["PERSIST"])
    grid_up = (min(ctas, triton.cdiv(I, cfg["BLOCK_N"]) * n),)
    grid_down = (min(ctas, triton.cdiv(L, cfg["BLOCK_N"]) * n),)
    if part != "down":
        x_desc = TensorDescriptor.from_tensor(xp, box, x_layout(cfg["BLOCK_M"]))
        _rega_up_kernel_p[grid_up](x_desc, tab, up_global, h, n, I, L, h.stride(0), geom.up_scales_off, **launch)
    if part != "up":
        h_desc = TensorDescriptor.from_tensor(h, box, x_layout(cfg["BLOCK_M"]))
        _rega_down_kernel_p[grid_down](h_desc, tab, down_global, w_sorted[lo:hi], tok_sorted[lo:hi], acc, n, L, I,
                                       geom.down_off, **launch)
    return acc


_ARG_TYPES = dict(x_ptr="*fp16", h_ptr="*fp16", table_ptr="*i64", gs_ptr="*fp32", w_ptr="*fp32", tok_ptr="*i64",
                  acc_ptr="*fp32", n_tiles="i32", I="i32", L="i32", stride_xm="i32", stride_hm="i32",
                  up_scales_off="i64", down_off="i64")
_ALIGNED = {"x_ptr", "h_ptr", "table_ptr", "gs_ptr", "w_ptr", "tok_ptr", "acc_ptr", "I", "L", "stride_xm", "stride_hm"}


def compile_offline(part: str, config: dict | None = None, arch: int = 90):
    """The up ("up") or down ("down") kernel of a config compiled for `arch` with the installed Triton, no GPU needed
    (the JIT's specialization of an engine launch: pointers 16-byte aligned, I / L / strides divisible by 16). With
    the device's Triton 3.6 on PYTHONPATH this is the device's own compile; bench/kernels/sass_probe reads the SASS,
    registers and spills of what it returns. Gluon has no interpreter: this is the CPU's only check of the kernels."""
    cfg = {**GLUON_CONFIG, **(config or {})}
    fn = globals()[f"_rega_{part}_kernel_{'p' if cfg.get('PERSIST') else 't' if cfg.get('TMA') else 'g'}"]
    return compile_gluon(fn, cfg, _ARG_TYPES, _ALIGNED, arch)


def compile_gluon(fn, cfg: dict, arg_types: dict, aligned: set, arch: int = 90):
    """A Gluon kernel compiled for `arch` as the JIT specializes an engine launch: the constexprs from cfg (else the
    kernel's defaults), each `*_desc` argument a [BLOCK_M, 64] fp16 TMA box in x_layout, the others typed by
    arg_types, and those in `aligned` divisible by 16 unless the kernel declares them varying."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    desc = f"tensordesc<fp16[{cfg['BLOCK_M']}, 64],{x_layout(cfg['BLOCK_M'])!r}>"
    sig, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if param.is_constexpr:
            sig[name] = "constexpr"
            constexprs[(i,)] = cfg.get(name, param.default if param.has_default else 0)   # the kernel's default
        else:
            sig[name] = desc if name.endswith("_desc") else arg_types[name]
            # (as the JIT specializes an aligned launch, except the arguments the kernel declares varying)
            if name in aligned and not (param.do_not_specialize or param.do_not_specialize_on_alignment):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=cfg["num_warps"]))


def compile_report(cases: list) -> list[dict]:
    """compile_offline over [(part, config, arch)]: each kernel's registers, spill stack bytes, shared memory and the
    main loop's writes to an in-flight wgmma's register operand (run without TRITON_INTERPRET: the interpreter's jit
    functions cannot be compiled)."""
    from bench.kernels.sass_probe import resources, sass, wgmma_operand_hazards
    rows = []
    for part, cfg, arch in cases:
        k = compile_offline(part, cfg, arch)
        regs, spill = resources(k)
        rows.append(dict(part=part, config=cfg, arch=arch, regs=regs, spill=spill, shared=k.metadata.shared,
                         hazards=wgmma_operand_hazards(sass(k))))
    return rows


def _parts_config(name: str) -> dict:
    """REGA_DEPTHS' names: "6" DEPTH 6, "5t" DEPTH 5 with x through TMA, "v2" / "v2n1" mma.sync with WARPS_N 2 / 1;
    suffixes: "nf" without the ring's proxy fence (FENCE 0), "so" the epilogue's stores from the MMA layout (STORE 0,
    session 39's), "w" 256-token tiles (BLOCK_M 256, STAGES 2: each weight decoded once for 256 rows), "s3" STAGES 3,
    "p" persistent (TMA only: one CTA an SM, x's ring across tiles), e.g. "7nfso", "1w", "5tws3", "5tpw"."""
    extra: dict = {}
    suffixes = {"so": dict(STORE=0), "w": dict(BLOCK_M=256, STAGES=2), "nf": dict(FENCE=0), "s3": dict(STAGES=3),
                "p": dict(PERSIST=True)}
    while tail := next((x for x in suffixes if name.endswith(x)), None):
        name = name.removesuffix(tail)
        for k, v in suffixes[tail].items():
            extra.setdefault(k, v)          # the rightmost suffix wins: "1ws3" is 256-token tiles at STAGES 3
    if name.startswith("v2"):
        return dict(GLUON_CONFIG, MMA=2, WARPS_N=1 if name == "v2n1" else 2, **extra)
    return dict(GLUON_CONFIG, DEPTH=int(name.rstrip("t")), TMA=name.endswith("t"), **extra)


def _dense_parts(geom, T, experts, xs, segs, addrs, ug, dg, ws, tok, acc) -> list[dict]:
    """The engine's dequantized path's two GEMMs alone (Triton's own pipelines over bf16 / fp16 weights already in
    VRAM, the same tiles and grid as rega's), and cuBLAS's batched GEMM on the same shapes: what a GEMM skeleton
    reaches on this geometry, beside rega's."""
    from bench.kernels.expert_prefill_sweep import median_seconds
    from kernels.expert_prefill import DEQUANT_CONFIG, DEQUANT_TMA_CONFIG, _chunk_launch, dense_gemms
    dev = xs.device
    up_w = torch.randn(experts, geom.I, geom.L, device=dev).mul_(0.03).bfloat16()
    down_w = torch.randn(experts, geom.L, geom.I, device=dev).mul_(0.03).half()
    rows = []
    for name, cfg in (("dense", DEQUANT_CONFIG), ("dense-tma", DEQUANT_TMA_CONFIG)):
        tab, n, lo, hi = _chunk_launch(segs, list(range(experts)), addrs, cfg["BLOCK_M"], None, dev)
        h = torch.empty((hi - lo) * geom.I, dtype=torch.float16, device=dev)
        for part in ("up", "down"):
            sec = median_seconds(lambda i, part=part: dense_gemms(xs, n, experts, geom, up_w, down_w, tab, lo, hi, ug,
                                                                  dg, ws, tok, acc, cfg, h, which=part), 8)
            rows.append(dict(T=T, config=name, probe=0, part=part, us=sec * 1e6,
                             tflops=2 * T * experts * geom.L * geom.I / sec / 1e12))
    # cuBLAS on the same shapes (every expert T rows, one batched GEMM a part): what the vendor's GEMM reaches here
    xb = torch.randn(experts, T, geom.L, device=dev).bfloat16()
    hb = torch.randn(experts, T, geom.I, device=dev).bfloat16()
    up_t, down_t = up_w.transpose(1, 2), down_w.bfloat16().transpose(1, 2)
    for part, a, b in (("up", xb, up_t), ("down", hb, down_t)):
        sec = median_seconds(lambda i, a=a, b=b: torch.bmm(a, b), 8)
        rows.append(dict(T=T, config="cublas", probe=0, part=part, us=sec * 1e6,
                         tflops=2 * T * experts * geom.L * geom.I / sec / 1e12))
    return rows


def parts(tokens=(256, 1024), experts=32, configs=None, out=None) -> list[dict]:
    """Where the time goes (GPU): each config's up and down launches alone, with the decode (PROBE 0), with the
    words loaded but not decoded (2), with no words (1: x's ring and the MMAs alone), with no words and no x (4), nor
    stores (5), beside the bf16 GEMM and the engine's GEMMs over weights already decoded (REGA_DENSE=0: not those).
    Environment: REGA_DEPTHS (names: _parts_config), REGA_PROBES, REGA_LI, REGA_TOKENS (e.g. "256,1024")."""
    import json
    import os
    from bench.kernels.expert_prefill_sweep import gemm_ceiling, make_blocks, median_seconds
    from kernels.expert_block import SUPER
    geom = SUPER
    if os.environ.get("REGA_LI"):          # e.g. "4096,2688": a longer K for the up (Super's latent L is 1,024)
        from kernels.expert_block import ExpertGeometry
        li = [int(v) for v in os.environ["REGA_LI"].split(",")]
        geom = ExpertGeometry(L=li[0], I=li[1], fmt="nvfp4")
    probes = [int(p) for p in os.environ.get("REGA_PROBES", "0,2,1").split(",")]
    if os.environ.get("REGA_TOKENS"):
        tokens = tuple(int(t) for t in os.environ["REGA_TOKENS"].split(","))
    # REGA_DEPTHS: names as _parts_config reads them, e.g. "6,6nf,7,5t,v2"
    names = os.environ.get("REGA_DEPTHS", "3,5,6").split(",")
    configs = configs or {d if d.startswith("v2") else f"d{d}": _parts_config(d) for d in names}
    gemm = gemm_ceiling()
    blocks, ug, dg = make_blocks(geom, 8, "cpu")
    dev = "cuda"
    vram = blocks.to(dev)[torch.arange(experts) % 8].contiguous()
    ug, dg = ug.to(dev)[torch.arange(experts) % 8], dg.to(dev)[torch.arange(experts) % 8]
    addrs = [vram[e].data_ptr() for e in range(experts)]
    rows = []
    for T in tokens:
        M = T * experts
        xs = torch.randn(M, geom.L, device=dev).bfloat16()
        ws = torch.rand(M, device=dev)
        tok = torch.arange(M, device=dev) % max(M // 4, 1)
        acc = torch.zeros(max(M // 4, 1), geom.L, device=dev)
        segs = [(e * T, T) for e in range(experts)]
        # the kernels are timed alone: the tile table and x's permutation (`prepare`) made once, and timed here
        # (the table cloned out of the launch-table ring, which later launches' tables overwrite in time)
        pre = {bm: prepare(xs, segs, addrs, geom, bm) for bm in {c["BLOCK_M"] for c in configs.values()}}
        pre = {bm: (p[0].clone(), *p[1:]) for bm, p in pre.items()}
        bm = min(pre)
        sec = median_seconds(lambda i: prepare(xs, segs, addrs, geom, bm), 8)
        rows.append(dict(T=T, config="prepare", probe=0, part="up", us=sec * 1e6, tflops=0.0, of_gemm=0.0))
        print(json.dumps(rows[-1]), flush=True)
        if os.environ.get("REGA_DENSE", "1") == "1":
            for r in _dense_parts(geom, T, experts, xs, segs, addrs, ug, dg, ws, tok, acc):
                rows.append(dict(r, of_gemm=r["tflops"] / gemm))
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                      flush=True)
        for name, cfg in configs.items():
            for probe in probes:
                if probe in (1, 3) and cfg.get("DEPTH") == 7:
                    continue        # a constant operand carried across blocks: ptxas serializes the wgmma (SASS)
                for part in ("up", "down"):
                    c = dict(cfg, PROBE=probe, PART=part)
                    sec = median_seconds(lambda i, c=c: rega_gluon(xs, segs, addrs, geom, ug, dg, ws, tok, acc,
                                                                     config=c, prepared=pre[c["BLOCK_M"]]), 8)
                    tf = 2 * T * experts * geom.L * geom.I / sec / 1e12
                    rows.append(dict(T=T, config=name, probe=probe, part=part, us=sec * 1e6, tflops=tf,
                                     of_gemm=tf / gemm))
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                          flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(dict(gemm_tflops=gemm, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"bf16 GEMM {gemm:.0f} TFLOP/s, L {geom.L} I {geom.I}; % of it by probe {probes} (0 decode, 2 words "
          "without decode, 1 no words, 3 no words and no stores, 4 no words and no x, 5 nor stores; dense: bf16 "
          "weights in VRAM, Triton; cublas: torch.bmm on the same shapes)")
    for T in tokens:
        prep = next(x["us"] for x in rows if x["T"] == T and x["config"] == "prepare")
        print(f"T={T:5d} prepare (tile table, x permuted; in the sweep's path, not in the rows below) {prep:.0f} us")
        for name in dict.fromkeys(x["config"] for x in rows if x["T"] == T and x["config"] != "prepare"):
            cells, us = [], []
            for part in ("up", "down"):
                r = {x["probe"]: x for x in rows if x["T"] == T and x["config"] == name and x["part"] == part}
                cells.append(f"{part} " + " / ".join(f"{100 * r[p]['of_gemm']:.1f}" for p in probes if p in r))
                us.append(r[probes[0]]["us"] if probes[0] in r else None)
            if None not in us:          # the two launches together (the same FLOPs each: by time, not the mean of %)
                cells.append(f"both {100 * 4 * T * experts * geom.L * geom.I / sum(us) / 1e6 / gemm:.1f}")
            print(f"T={T:5d} {name:5s} " + "   ".join(cells))
    return rows


if __name__ == "__main__":      # python -m bench.kernels.expert_prefill_rega_gluon (GPU): the parts table
    import os
    parts(out=os.path.join(os.environ["OUT"], "rega_parts.json") if os.environ.get("OUT") else None)
