"""Variants of the grouped expert prefill (issue 13, part 2), each with the entry of
`kernels.expert_prefill.expert_prefill_grouped` (x sorted by expert, segments, block addresses, acc += w · y), so
that bench/kernels/expert_prefill_sweep.py checks and times them side by side. Only the winner moves into kernels/.

  fused      the engine's kernel as it stands (NVFP4 decoded per tile with byte loads, two K/2 dots), any config
  quad       the same tile loop with issue 19's decode: the weight tile read as int16 (4 codes each), decoded by
             code position J (inline PTX on the GPU), scales multiplied on the decoded fp16 tile, four K/4 dots
  dequant    decode each chunk of experts' NVFP4 blocks into a dense scratch (up as bf16 [I, L], down as fp16
             [L, I]; e2m1 · e4m3 is exact in both), then a grouped Triton GEMM whose operands are plain loads
             (what Triton pipelines into wgmma best); the same epilogues as the fused kernel. Run 1's winner:
             it now lives in kernels/expert_prefill.py and this entry calls it
  dequant_pipe  the dequantized path with the decode of chunk i+1 on a side stream beside chunk i's GEMMs (two
             scratch sets): the decode is memory-bound and the GEMMs compute-bound, and kernels/ runs them one after
             the other (at 256 tokens per expert the decode is ~40 % of the path: 136 of ~360 µs for 32 experts).
             Lost on the H200 (session 21: host-bound per chunk); kept here with its timings
  rega       (session 37) x's columns permuted so that each code word's nibble pairs are the tensor cores' register
             operand as they come: the weights decoded once per tile in registers, never written out
             (kernels/expert_prefill_rega.py: the Triton twin; rega_gluon: the Gluon kernel, GPU only)
  grouped_mm dequantize into bf16, then torch._grouped_mm (CUTLASS on sm90); bf16 in and out only, so the ReLU²
             rows and y are rounded to bf16: a speed reference that the 1e-3 twin check is expected to refuse
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.expert_prefill_rega import rega
from kernels import expert_prefill as ep
from kernels.expert_prefill import dequantize, expert_prefill_grouped, tile_table
from kernels.gemv_nvfp4 import _X_PRESCALE, _e2m1_quad, _nvfp4_tile_split

USE_ASM = torch.cuda.is_available()    # the interpreter cannot run inline PTX: the same bit moves in Triton ops


def fused(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, config=None):
    return expert_prefill_grouped(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc,
                                  config=config, path="fused")


def _check(geom, segments, addrs, up_global, down_global, x_sorted, w_sorted, tok_sorted, acc):
    assert geom.fmt == "nvfp4" and geom.down_group_neurons == 16, "variants read unsplit NVFP4 blocks"
    assert len(segments) == len(addrs) == up_global.numel() == down_global.numel()
    assert x_sorted.shape[1] == geom.L and x_sorted.stride(1) == 1 and acc.shape[1] == geom.L and acc.is_contiguous()
    assert acc.dtype == torch.float32 and w_sorted.dtype == torch.float32 and tok_sorted.dtype == torch.int64


def _table(segments, block_m, addrs, device):
    """The tile table of `segments`, rows re-based to the first used row, addresses appended; (tab, n, lo, hi)."""
    table = tile_table(segments, block_m)
    if not table:
        return None, 0, 0, 0
    used = [(s, n) for s, n in segments if n > 0]
    lo, hi = min(s for s, _ in used), max(s + n for s, n in used)
    flat = [v for (i, m0, m1) in table for v in (i, m0 - lo, m1 - lo)] + [int(a) for a in addrs]
    tab = torch.tensor(flat, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    return tab, len(table), lo, hi


# ------------------------------------------------------------------------------------------------ quad
@triton.jit
def _quad_tile_dot(x_ptr, stride_xm, o_m, m_m, w_ptr, s_ptr, o_n, m_n, N, K, LAYOUT: tl.constexpr,
                   X_PRESCALED: tl.constexpr, USE_ASM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ_k W[n, k] x[m, k] for one (BLOCK_N, BLOCK_M) tile, times 2^-15 (global scale not applied).
    W read as int16: 4 codes, k = 4q + J, low nibble first. LAYOUT 0: row-major [N, K/2] bytes, scales [N, K/16];
    LAYOUT 1: down groups of 16 neurons, group g = values [N, 8] bytes (4 int16 per row), scales [N]."""
    Q: tl.constexpr = BLOCK_K // 4
    G: tl.constexpr = BLOCK_K // 16
    o_i = tl.arange(0, Q)
    o_k = tl.arange(0, BLOCK_K)
    w16 = w_ptr.to(tl.pointer_type(tl.int16))
    b_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q = k0 // 4 + o_i
        o_g = k0 // 16 + tl.arange(0, G)
        if LAYOUT == 0:
            p_w = w16 + o_n[:, None] * (K // 4) + q[None, :]
            p_s = s_ptr + o_n[:, None] * (K // 16) + o_g[None, :]
        else:
            p_w = w16 + (q // 4)[None, :] * (9 * N // 2) + o_n[:, None] * 4 + (q % 4)[None, :]
            p_s = s_ptr + o_g[None, :] * (9 * N) + 8 * N + o_n[:, None]
        b_h = tl.load(p_w, mask=m_n[:, None] & (q[None, :] < K // 4), other=0)
        b_s = tl.load(p_s, mask=m_n[:, None] & (o_g[None, :] < K // 16), other=0)
        b_s = (b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 128.0).to(tl.float16)
        b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_N, G, 4)), (BLOCK_N, Q))
        m_xr = m_m[:, None] & ((k0 + o_k)[None, :] < K)
        b_x = tl.load(x_ptr + o_m[:, None] * stride_xm + (k0 + o_k)[None, :], mask=m_xr, other=0.0)
        if not X_PRESCALED:
            b_x = (b_x.to(tl.float32) * _X_PRESCALE).to(tl.float16)
        x_b0, x_b1 = tl.split(tl.reshape(b_x, (BLOCK_M, Q, 2, 2)))     # k = 4q + 2a + b: split b, then a
        x_0, x_2 = tl.split(x_b0)
        x_1, x_3 = tl.split(x_b1)
        b_acc = tl.dot(_e2m1_quad(b_h, 0, USE_ASM) * b_s, tl.trans(x_0), b_acc)
        b_acc = tl.dot(_e2m1_quad(b_h, 1, USE_ASM) * b_s, tl.trans(x_1), b_acc)
        b_acc = tl.dot(_e2m1_quad(b_h, 2, USE_ASM) * b_s, tl.trans(x_2), b_acc)
        b_acc = tl.dot(_e2m1_quad(b_h, 3, USE_ASM) * b_s, tl.trans(x_3), b_acc)
    return b_acc * 32768.0   # 2^7 (tile) · 2^8 (x prescale)


@triton.jit
def _quad_up_kernel(x_ptr, table_ptr, gs_ptr, h_ptr, n_tiles, I, L, stride_xm, up_scales_off,
                    USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    i = tl.load(table_ptr + 3 * t)
    m0 = tl.load(table_ptr + 3 * t + 1)
    m1 = tl.load(table_ptr + 3 * t + 2)
    base = tl.load(table_ptr + 3 * n_tiles + i).to(tl.pointer_type(tl.uint8))
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_n = o_n < I
    m_m = o_m < m1
    b_h = _quad_tile_dot(x_ptr, stride_xm, o_m, m_m, base, base + up_scales_off, o_n, m_n, I, L, 0, False, USE_ASM,
                         BLOCK_M, BLOCK_N, BLOCK_K) * tl.load(gs_ptr + i)
    b_h = tl.maximum(b_h, 0.0)
    b_h = (b_h * b_h * _X_PRESCALE).to(tl.float16)
    tl.store(h_ptr + o_m[None, :] * I + o_n[:, None], b_h, mask=m_n[:, None] & m_m[None, :])


@triton.jit
def _quad_down_kernel(h_ptr, table_ptr, gs_ptr, w_ptr, tok_ptr, acc_ptr, n_tiles, L, I, down_off,
                      USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    i = tl.load(table_ptr + 3 * t)
    m0 = tl.load(table_ptr + 3 * t + 1)
    m1 = tl.load(table_ptr + 3 * t + 2)
    base = tl.load(table_ptr + 3 * n_tiles + i).to(tl.pointer_type(tl.uint8)) + down_off
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_n = o_n < L
    m_m = o_m < m1
    b_y = _quad_tile_dot(h_ptr, I, o_m, m_m, base, base, o_n, m_n, L, I, 1, True, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)
    b_y = b_y * tl.load(gs_ptr + i) * tl.load(w_ptr + o_m, mask=m_m, other=0.0)[None, :]
    tok = tl.load(tok_ptr + o_m, mask=m_m, other=0)
    tl.atomic_add(acc_ptr + tok[None, :] * L + o_n[:, None], b_y, mask=m_n[:, None] & m_m[None, :])


QUAD_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def quad(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, config=None):
    _check(geom, segments, addrs, up_global, down_global, x_sorted, w_sorted, tok_sorted, acc)
    cfg = {**QUAD_CONFIG, **(config or {})}
    assert cfg["BLOCK_K"] % 16 == 0
    L, I = geom.L, geom.I
    tab, n, lo, hi = _table(segments, cfg["BLOCK_M"], addrs, x_sorted.device)
    if not n:
        return acc
    h = torch.empty((hi - lo) * I, dtype=torch.float16, device=x_sorted.device)
    _quad_up_kernel[(triton.cdiv(I, cfg["BLOCK_N"]), n)](x_sorted[lo:hi], tab, up_global, h, n, I, L,
                                                         x_sorted.stride(0), geom.up_scales_off, USE_ASM=USE_ASM,
                                                         **cfg)
    _quad_down_kernel[(triton.cdiv(L, cfg["BLOCK_N"]), n)](h, tab, down_global, w_sorted[lo:hi], tok_sorted[lo:hi],
                                                           acc, n, L, I, geom.down_off, USE_ASM=USE_ASM, **cfg)
    return acc


# ------------------------------------------------------------------------------------------------ dequant
def dequant(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, config=None):
    """The winner of run 1, now in kernels/expert_prefill.py (`_grouped_dequant`); config CHUNK = experts a chunk.
    Run 1 ran an earlier copy of it whose chunks each waited for the stream (a pageable index copy)."""
    return expert_prefill_grouped(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc,
                                  config=config, path="dequant")


# ------------------------------------------------------------------------------------------------ dequant_pipe
# Session 20 built this in kernels/ behind MOESTREAM_DEQUANT_PIPE; session 21 measured it on the H200 (bench/NOTES.md):
# it lost at every size, the more chunks the worse (256 rows an expert, 32 experts: 236 TFLOP/s in series, 170 / 92 /
# 47 in chunks of 16 / 8 / 4; the engine's 16k prompt +20 ms). Each chunk is host work (its table's fetch and event,
# the decode, two GEMM launches and their descriptors, the stream waits) that the device waits for: ~150-220 µs a
# chunk against ~56 µs of GEMMs. It moved here, out of kernels/, with its tests.
PIPE_CHUNK = 8
_SIDE_STREAMS: dict = {}


def _side_stream(dev) -> torch.cuda.Stream:
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(torch.device("cuda", key))
    return _SIDE_STREAMS[key]


def dequant_pipe(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, config=None):
    """kernels' dequantized path with chunks of CHUNK experts (PIPE_CHUNK), each decoded one ahead on a side stream
    into the other of two scratch sets. Stream order: chunk i+1's decode waits for the compute stream's work queued so
    far (its table's fetch, and chunk i-1's GEMMs: the last readers of the scratch set it writes) and is queued before
    chunk i's GEMMs, which it overlaps; chunk i+1's GEMMs wait for its decode. On the CPU the same calls run in order."""
    _check(geom, segments, addrs, up_global, down_global, x_sorted, w_sorted, tok_sorted, acc)
    cfg = {**ep.dequant_config(segments), **(config or {})}
    L, I, dev = geom.L, geom.I, x_sorted.device
    live = [i for i, (_, n) in enumerate(segments) if n > 0]
    if not live:
        return acc
    C = min(cfg.pop("CHUNK", None) or PIPE_CHUNK, len(live))
    chunks = [live[c:c + C] for c in range(0, len(live), C)]
    scratch = [(torch.empty((C, I, L), dtype=torch.bfloat16, device=dev),
                torch.empty((C, L, I), dtype=torch.float16, device=dev)) for _ in range(min(2, len(chunks)))]
    cuda = dev.type == "cuda"
    main = torch.cuda.current_stream(dev) if cuda else None
    side = _side_stream(dev) if cuda else None

    def decode(i, tab, n_tiles):
        up_w, down_w = scratch[i % 2]
        blocks = ep._chunk_blocks(tab, n_tiles, len(chunks[i]))
        if not cuda:
            dequantize(blocks, geom, up_w, down_w)
            return None
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dequantize(blocks, geom, up_w, down_w)
        done = torch.cuda.Event()
        done.record(side)
        return done

    tabs = [ep._chunk_launch(segments, chunks[0], addrs, cfg["BLOCK_M"], None, dev)]
    pending = decode(0, *tabs[0][:2])
    h = None
    for i in range(len(chunks)):
        ahead = None
        if i + 1 < len(chunks):
            tabs.append(ep._chunk_launch(segments, chunks[i + 1], addrs, cfg["BLOCK_M"], None, dev))
            ahead = decode(i + 1, *tabs[i + 1][:2])
        if pending is not None:
            main.wait_event(pending)
        tab, n_tiles, lo, hi = tabs[i]
        up_w, down_w = scratch[i % 2]
        h = ep.dense_gemms(x_sorted, n_tiles, len(chunks[i]), geom, up_w, down_w, tab, lo, hi, up_global, down_global,
                           w_sorted, tok_sorted, acc, cfg, h)
        pending = ahead
    return acc


# ------------------------------------------------------------------------------------------------ grouped_mm
def grouped_mm(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, config=None):
    """Dequantize every expert of the launch into bf16, then torch._grouped_mm for up and down (bf16 out)."""
    _check(geom, segments, addrs, up_global, down_global, x_sorted, w_sorted, tok_sorted, acc)
    L, I, dev = geom.L, geom.I, x_sorted.device
    live = [i for i, (_, n) in enumerate(segments) if n > 0]
    if not live:
        return acc
    rows = torch.cat([torch.arange(segments[i][0], segments[i][0] + segments[i][1]) for i in live]).to(dev)
    sel = torch.tensor(live, dtype=torch.int64).to(dev)
    ad = torch.tensor([int(addrs[i]) for i in live], dtype=torch.int64).to(dev)
    up_w = torch.empty((len(live), I, L), dtype=torch.bfloat16, device=dev)
    down_w = torch.empty((len(live), L, I), dtype=torch.bfloat16, device=dev)
    dequantize(ad, geom, up_w, down_w, down_bf16=True)
    counts = torch.tensor([segments[i][1] for i in live], dtype=torch.int64)
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    row_e = torch.repeat_interleave(torch.arange(len(live)), counts).to(dev)
    h = torch._grouped_mm(x_sorted[rows], up_w.transpose(1, 2), offs=offs)
    h = (torch.relu(h.float() * up_global[sel][row_e][:, None]) ** 2).bfloat16()
    y = torch._grouped_mm(h, down_w.transpose(1, 2), offs=offs)
    y = y.float() * (down_global[sel][row_e] * w_sorted[rows])[:, None]
    acc.index_add_(0, tok_sorted[rows], y)
    return acc


def rega_gluon(*args, **kwargs):
    from bench.kernels.expert_prefill_rega_gluon import rega_gluon as fn     # Gluon compiles for a GPU only
    return fn(*args, **kwargs)


VARIANTS = dict(fused=fused, quad=quad, dequant=dequant, dequant_pipe=dequant_pipe, grouped_mm=grouped_mm, rega=rega,
                rega_gluon=rega_gluon)
