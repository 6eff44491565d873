"""Routed experts at prefill: every expert of a MoE layer on the tokens routed to it, as tensor-core GEMMs.

`expert_prefill_grouped` is the engine's: one grouped computation for a whole group of experts (all of a layer's
hits at once, or the misses as they land), over the tokens sorted by expert. The host knows how many tokens each
expert has (one sync per layer), so it cuts each expert's rows into BLOCK_M tiles and sends one table; a program
takes one (tile, BLOCK_N columns) pair. Three paths, chosen by the rows per routed expert (`grouped_path`):
- rega (sm_90, up to REGA_TILE_ROWS rows an expert, REGA_RESIDENT_MAX_ROWS with weights in device memory): x's rows
  permuted to fp16 once, then an up and a down launch that decode NVFP4 straight into wgmma's register operand
  (kernels/expert_prefill_rega.py has the scheme and its twin, kernels/expert_prefill_rega_gluon.py the kernels);
- fused (few rows): one up and one down launch; each program reads its expert's block by address (the pinned
  slab zero-copy, VRAM, or a device ring the copy engine staged it into) and decodes NVFP4 in its tile loop;
- dequantized (from DEQUANT_MIN_TOKENS rows per expert; bf16 x): per chunk of experts, one launch decodes their
  blocks (read once, wherever they lie) into a bf16/fp16 scratch, then an up and a down GEMM over plain loads,
  which Triton pipelines far better than a tile decoded in registers (bench/NOTES.md, issue 13 part 2). Its two
  GEMMs may instead run as torch._grouped_mm (CUTLASS on sm90; bf16 h and y): MOESTREAM_EXPERT_GEMM (`expert_gemm`).
Either way the down launch adds w[t] · y into the layer's accumulator with fp32 atomics (relaxed: `atomic_sem`;
the sum order over experts varies from run to run), no host sync per expert, and the intermediate ReLU² rows are
stored as fp16 already multiplied by 2^-8: exactly what the fused down GEMM would have converted them to on loading.
Both read 16-neuron down groups: a store split into sub-groups (`--down-group-neurons` < 16) has the launch's down
sections regrouped into 16-neuron groups on the device first (`regroup_downs`, one launch, exact), then runs as an
unsplit store does.

`expert_prefill` (one expert per call) is the first build's, kept for bench/kernels.

y[t, :] = w[t] · down(relu(up x[t])²) for the T tokens given; the caller scatters y into the chunk's
accumulator. The expert's block is read where it lies (VRAM or the mapped slab, by address), in the block
layout (docs/block-layout.md): up as a row-major NVFP4 matrix, down through its 16-neuron groups (LAYOUT 1
of `_nvfp4_tile_fp16`). Each weight tile is decoded once per BLOCK_M tokens, so the decode is amortised.
A store split into down sub-groups (`--down-group-neurons` < 16) has its expert's down section regrouped into
16-neuron groups in a device buffer first (one small copy kernel), then the same GEMM runs.
"""
from __future__ import annotations

import functools
import os
from itertools import chain

import torch
import triton
import triton.language as tl

from kernels.backend import varying
from kernels.expert_block import GROUP, ExpertGeometry
from kernels.expert_up import up_weight_torch
from kernels.launch_tables import device_table
from kernels.gemv_bf16 import _to_bf16
from kernels.gemv_nvfp4 import _X_PRESCALE, _nvfp4_gemm_body, _nvfp4_tile_split
from kernels.sparse_down import down_group_weights_torch


@triton.jit
def _expert_gemm_kernel(
    x_ptr, addr_ptr, j, section_off, scale_off, gs_ptr, y_ptr, row_scale_ptr,
    M, N, K, stride_xm, stride_ym,
    LAYOUT: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, RELU2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    base = tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8))
    _nvfp4_gemm_body(x_ptr, base + section_off, base + scale_off, tl.load(gs_ptr + j), y_ptr, row_scale_ptr,
                     M, N, K, stride_xm, stride_ym, LAYOUT, HAS_ROW_SCALE, RELU2, BLOCK_M, BLOCK_N, BLOCK_K)


def expert_prefill(x: torch.Tensor, addrs: torch.Tensor, j: int, geom: ExpertGeometry, up_global: torch.Tensor,
                   down_global: torch.Tensor, token_weights: torch.Tensor, config: dict | None = None):
    """x [T, L] tokens routed to expert addrs[j]; up/down_global fp32 [k]; token_weights fp32 [T] -> y fp32 [T, L]."""
    assert geom.fmt == "nvfp4"
    L, I = geom.L, geom.I
    T = x.shape[0]
    assert x.shape == (T, L) and x.stride(-1) == 1 and token_weights.shape == (T,)
    cfg = {**dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3), **(config or {})}
    if T <= 16:
        cfg["BLOCK_M"] = 16
    h = torch.empty((T, I), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(I, cfg["BLOCK_N"]), triton.cdiv(T, cfg["BLOCK_M"]))
    _expert_gemm_kernel[grid](x, addrs, j, 0, geom.up_scales_off, up_global, h, token_weights,
                              T, I, L, x.stride(0), h.stride(0),
                              LAYOUT=0, HAS_ROW_SCALE=False, RELU2=True, **cfg)
    y = torch.empty((T, L), dtype=torch.float32, device=x.device)
    d_addrs, d_j, d_off, d_global = addrs, j, geom.down_off, down_global
    if geom.down_group_neurons != GROUP:     # LAYOUT 1 reads 16-neuron groups: regroup the sub-groups first
        regrouped = regroup_down(addrs, j, geom)    # alive until the GEMM is queued (stream-ordered reuse after)
        d_addrs = torch.full((1,), regrouped.data_ptr(), dtype=torch.int64, device=addrs.device)   # no host sync
        d_j, d_off, d_global = 0, 0, down_global[j:]
    grid = (triton.cdiv(L, cfg["BLOCK_N"]), triton.cdiv(T, cfg["BLOCK_M"]))
    _expert_gemm_kernel[grid](h, d_addrs, d_j, d_off, d_off, d_global, y, token_weights,
                              T, L, I, h.stride(0), y.stride(0),
                              LAYOUT=1, HAS_ROW_SCALE=True, RELU2=False, **cfg)
    return y


@triton.jit
def _subgroup_codes(base, g, o_l, m_l, m, L, SUB: tl.constexpr):
    """4-bit codes [BLOCK_L, 8] of neurons m (of 16-group g) in a block split into sub-groups of SUB neurons."""
    s = g * (16 // SUB) + m // SUB                            # the neurons' sub-groups
    q = o_l[:, None] * SUB + (m % SUB)[None, :]               # their nibbles inside those sub-groups' values
    b = tl.load(base + s[None, :].to(tl.int64) * (L * SUB // 2 + L) + q // 2, mask=m_l[:, None], other=0)
    return (b.to(tl.int32) >> ((q % 2) * 4)) & 15


@triton.jit
def _regroup_down_kernel(addr_ptr, down_off, out_ptr, out_stride, L, SUB: tl.constexpr, BLOCK_L: tl.constexpr):
    """16-neuron group g (program 0) of the block at addr_ptr[c] (program 2), split into sub-groups of SUB neurons,
    written in the 16-neuron layout at out + c · out_stride: values [L, 8] (neurons 2t, 2t+1 in byte t) then the
    scales [L] of the group's first sub-group."""
    g = tl.program_id(0)
    c = tl.program_id(2)
    o_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    m_l = o_l < L
    base = tl.load(addr_ptr + c).to(tl.pointer_type(tl.uint8)) + down_off
    o_t = tl.arange(0, 8)
    lo = _subgroup_codes(base, g, o_l, m_l, 2 * o_t, L, SUB)
    hi = _subgroup_codes(base, g, o_l, m_l, 2 * o_t + 1, L, SUB)
    out = out_ptr + c.to(tl.int64) * out_stride + g.to(tl.int64) * (9 * L)
    tl.store(out + o_l[:, None] * 8 + o_t[None, :], (lo | (hi << 4)).to(tl.uint8), mask=m_l[:, None])
    sc = tl.load(base + (g * (16 // SUB)).to(tl.int64) * (L * SUB // 2 + L) + L * SUB // 2 + o_l, mask=m_l, other=0)
    tl.store(out + 8 * L + o_l, sc, mask=m_l)


def regrouped_bytes(geom: ExpertGeometry) -> int:
    """Bytes of one expert's down section rewritten as 16-neuron groups (an unsplit block's down section)."""
    return geom.n_scale_groups * 9 * geom.L


def regroup_downs(addrs: torch.Tensor, geom: ExpertGeometry, out: torch.Tensor | None = None,
                  block_l: int = 128) -> torch.Tensor:
    """The down sections of the blocks at addrs (int64 [C] on the device; sub-groups of geom.down_group_neurons
    neurons) rewritten as 16-neuron groups into out[c] (U8 [>= C, regrouped_bytes], a new buffer if None), one
    launch. A GEMM that reads 16-neuron groups then reads out[c] as expert c's down section (at offset 0)."""
    assert geom.fmt == "nvfp4" and geom.down_group_neurons != GROUP
    C, nb = addrs.numel(), regrouped_bytes(geom)
    if out is None:
        out = torch.empty((C, nb), dtype=torch.uint8, device=addrs.device)
    assert out.dtype == torch.uint8 and out.dim() == 2 and out.shape[0] >= C and out.shape[1] == nb
    assert out.is_contiguous()
    if C:
        grid = (geom.n_scale_groups, triton.cdiv(geom.L, block_l), C)
        _regroup_down_kernel[grid](addrs, geom.down_off, out, nb, geom.L, SUB=geom.down_group_neurons,
                                   BLOCK_L=block_l)
    return out


def regroup_down(addrs: torch.Tensor, j: int, geom: ExpertGeometry, block_l: int = 128) -> torch.Tensor:
    """The down section of block addrs[j] (sub-groups of geom.down_group_neurons neurons) rewritten as 16-neuron
    groups (the layout of an unsplit block's down section) into a new device buffer, U8 [I/16 · 9L]."""
    return regroup_downs(addrs[j:j + 1], geom, block_l=block_l).reshape(-1)


def expert_prefill_torch(x: torch.Tensor, blk: torch.Tensor, geom: ExpertGeometry, up_global, down_global,
                         token_weights: torch.Tensor) -> torch.Tensor:
    """Twin: decode the whole expert from its block, then two matmuls in fp32."""
    up = up_weight_torch(geom, blk, up_global)                                          # [I, L]
    down = down_group_weights_torch(geom, blk, down_global).permute(1, 0, 2).reshape(geom.L, geom.I)
    a = torch.relu(x.float() @ up.t()) ** 2
    return (a @ down.t()) * token_weights.float()[:, None]


# ------------------------------------------------------------------------------------------------ grouped
@triton.jit
def _tile_dot(x_ptr, stride_xm, o_m, m_m, w_ptr, s_ptr, o_n, m_n, N, K, LAYOUT: tl.constexpr,
              X_PRESCALED: tl.constexpr, X_LOAD: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ_k W[n, k] x[m, k] for one (BLOCK_N, BLOCK_M) tile, global scale not applied. x rows at o_m (int64).
    X_LOAD 0: x's even and odd columns in two strided loads; 1: one contiguous [BLOCK_M, BLOCK_K] load, split."""
    b_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    o_j = tl.arange(0, BLOCK_K // 2)
    o_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        a_lo, a_hi = _nvfp4_tile_split(w_ptr, s_ptr, o_n, m_n, k0, K, N, LAYOUT, BLOCK_K)
        if X_LOAD == 1:
            m_xr = m_m[:, None] & ((k0 + o_k)[None, :] < K)
            b_x = tl.load(x_ptr + o_m[:, None] * stride_xm + (k0 + o_k)[None, :], mask=m_xr, other=0.0)
            x_e, x_o = tl.split(tl.reshape(b_x, (BLOCK_M, BLOCK_K // 2, 2)))
            x_e = tl.trans(x_e)
            x_o = tl.trans(x_o)
        else:
            k_e = k0 + 2 * o_j
            m_x = m_m[None, :] & (k_e[:, None] < K)
            p_x = x_ptr + o_m[None, :] * stride_xm + k_e[:, None]
            x_e = tl.load(p_x, mask=m_x, other=0.0)
            x_o = tl.load(p_x + 1, mask=m_x, other=0.0)
        if X_PRESCALED:
            b_acc = tl.dot(a_lo, x_e, b_acc)
            b_acc = tl.dot(a_hi, x_o, b_acc)
        else:
            b_acc = tl.dot(a_lo, (x_e.to(tl.float32) * _X_PRESCALE).to(tl.float16), b_acc)
            b_acc = tl.dot(a_hi, (x_o.to(tl.float32) * _X_PRESCALE).to(tl.float16), b_acc)
    return b_acc * 32768.0   # 2^7 (tile) · 2^8 (x prescale)


@triton.jit(**varying("table_ptr", "n_tiles"))
def _grouped_up_kernel(
    # tensors
    x_ptr, table_ptr, gs_ptr, h_ptr,
    # sizes
    n_tiles, I, L, stride_xm, up_scales_off,
    # config
    X_LOAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    i = tl.load(table_ptr + 3 * t)                    # the expert's index in this launch
    m0 = tl.load(table_ptr + 3 * t + 1)
    m1 = tl.load(table_ptr + 3 * t + 2)
    base = tl.load(table_ptr + 3 * n_tiles + i).to(tl.pointer_type(tl.uint8))
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_n = o_n < I
    m_m = o_m < m1
    b_h = _tile_dot(x_ptr, stride_xm, o_m, m_m, base, base + up_scales_off, o_n, m_n, I, L, 0, False, X_LOAD,
                    BLOCK_M, BLOCK_N, BLOCK_K) * tl.load(gs_ptr + i)
    b_h = tl.maximum(b_h, 0.0)
    b_h = (b_h * b_h * _X_PRESCALE).to(tl.float16)    # what the down GEMM's x load would make of it
    tl.store(h_ptr + o_m[None, :] * I + o_n[:, None], b_h, mask=m_n[:, None] & m_m[None, :])


@triton.jit(**varying("table_ptr", "w_ptr", "tok_ptr", "n_tiles"))
def _grouped_down_kernel(
    # tensors
    h_ptr, table_ptr, gs_ptr, w_ptr, tok_ptr, acc_ptr,
    # sizes
    n_tiles, L, I, down_off,
    # config
    X_LOAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SEM: tl.constexpr = "relaxed",
):
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
    b_y = _tile_dot(h_ptr, I, o_m, m_m, base, base, o_n, m_n, L, I, 1, True, X_LOAD, BLOCK_M, BLOCK_N, BLOCK_K)
    b_y = b_y * tl.load(gs_ptr + i) * tl.load(w_ptr + o_m, mask=m_m, other=0.0)[None, :]
    tok = tl.load(tok_ptr + o_m, mask=m_m, other=0)
    tl.atomic_add(acc_ptr + tok[None, :] * L + o_n[:, None], b_y, mask=m_n[:, None] & m_m[None, :], sem=SEM)


# bench/prefill.py's sweep (H200, 32 experts, weights in VRAM): this shape 117 / 139 TFLOP/s at 256 / 1,024 tokens
# per expert; the first default (X_LOAD 0, BLOCK_M 64) 61 / 71; X_LOAD 1 alone 94 / 111 (bench/NOTES.md)
GROUPED_CONFIG = dict(X_LOAD=1, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
# the dequantized path (bench/kernels/expert_prefill_sweep.py, H200, 32 experts): 201 / 294 TFLOP/s at 256 / 1,024
# tokens per expert against the fused kernel's 121 / 141; 76 against 59 at 64; a tie at 16 (bench/NOTES.md)
DEQUANT_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4)
DEQUANT_MIN_TOKENS = 32          # mean rows per routed expert of a launch from which the dequantized path runs
# both GEMM operands through TMA descriptors, 3 stages: 389 TFLOP/s at 1,024 tokens per expert against 309 with
# pointer loads (every TMA config of run 2 won there, 322-389), but 162 against 207 at 256 (session 12, run 2, with
# the barriered atomics); with relaxed atomics (session 16, call 2) 219 against 155 at 256 and 387 against 305 at 688:
# from 256 on. MOESTREAM_DEQUANT_TMA_MIN_TOKENS (read per call) moves the threshold for an A/B. Only in a launch of
# DEQUANT_TMA_MIN_EXPERTS experts or more: each chunk builds four tensor descriptors on the host, and under a
# prefill budget (launches of ~5-12 experts, 335 launches at 16k under 512 MiB) that host time lost more than the
# GEMMs won (session 16, call 5: 16k 515 / 595 ms against 475 / 411 with pointer loads, a host-bound H200).
DEQUANT_TMA_CONFIG = dict(DEQUANT_CONFIG, num_stages=3, TMA=True)
DEQUANT_TMA_MIN_TOKENS = 256
DEQUANT_TMA_MIN_EXPERTS = 16
DEQUANT_TMA_ENV = "MOESTREAM_DEQUANT_TMA_MIN_TOKENS"
# the decoded scratch (4 · L · I bytes per expert, 11 MB on Super; 2 · L · I with `one_scratch`) is at most this: 32
# Super experts (two scratches), a whole grouped launch of gpu_worker/prefill_knobs.py's PREFILL_LAUNCH_EXPERTS
# decoded at once; a small budget's launches hold fewer experts, and the scratch is only as large as a launch's
# experts (`launch_limits` charges it per expert); the sweep lost 45 % at 256 tokens per expert when it ran in chunks
# of 16 with a sync per chunk
DEQUANT_SCRATCH_BYTES = 384 << 20


def dequant_scratch_bytes() -> int:
    """The decoded scratch at most: MOESTREAM_DEQUANT_SCRATCH_MB (MiB, read per call; a measuring knob for fewer,
    larger chunks), else DEQUANT_SCRATCH_BYTES."""
    raw = os.environ.get("MOESTREAM_DEQUANT_SCRATCH_MB", "")
    if raw and (not raw.isdigit() or int(raw) < 1):
        raise ValueError(f"MOESTREAM_DEQUANT_SCRATCH_MB={raw!r}: expected a whole number of MiB, 1 or more")
    return int(raw) << 20 if raw else DEQUANT_SCRATCH_BYTES


# MOESTREAM_DEQUANT_ONE_SCRATCH (read per launch; 1 by default, 0: two scratches): the dequantized path decodes a
# chunk's ups, runs the up GEMM, then decodes its downs into the same scratch (fp16 [L, I] has the bf16 [I, L]'s
# bytes) and runs the down GEMM: 2 · L · I bytes an expert instead of 4 (5.5 MB of Super's 11), the same kernels in
# the same stream order. Under a small budget a launch then takes more experts (`launch_limits` charges this per
# expert): session 35 (H100, 8 MoE layers, alternated in one engine) 512 MiB 4k 436-444 -> 342-345 ms, 16k 867-871 ->
# 777-784, 1 GiB 4k 283-285 -> 246-277, 16k 551-561 -> 520-542: lower in 8 of 8 pairs, first tokens equal
# (bench/NOTES.md).
ONE_SCRATCH_ENV = "MOESTREAM_DEQUANT_ONE_SCRATCH"


def one_scratch() -> bool:
    """Whether the dequantized path decodes the ups and the downs into one scratch in turn
    ($MOESTREAM_DEQUANT_ONE_SCRATCH "1" or unset; "0": two scratches, both decoded before the GEMMs)."""
    raw = os.environ.get(ONE_SCRATCH_ENV, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{ONE_SCRATCH_ENV}={raw!r}: expected 0 or 1")
    return raw != "0"


def scratch_per_expert(L: int, I: int) -> int:
    """The dequantized path's decoded scratch an expert takes (`one_scratch`: the up's bytes, shared with the down)."""
    return (2 if one_scratch() else 4) * L * I


# a sub-grouped store's fused launch regroups its experts' down sections (1.5 MB per Super expert) into one
# scratch of at most this; more experts run as several launches
REGROUP_SCRATCH_BYTES = 384 << 20
# The down launches add into the layer's accumulator with fp32 atomics. Triton's default for tl.atomic_add is
# sem="acq_rel", which on sm_90 compiles each of a thread's 16 vector atomics of a 128 x 128 tile to ATOMG behind a
# MEMBAR.ALL.GPU and an L1 invalidate (CCTL.IVALL): the epilogue waits for every memory operation in flight, 16 times.
# Nothing reads the accumulator before the launch ends (the kernel boundary orders it), so atomicity is all the sum
# needs: "relaxed" compiles to REDG without barriers (bench/kernels/sass_probe.py --atomics shows both).
# MOESTREAM_PREFILL_ATOMIC_SEM (read per call): "acq_rel" brings the old epilogue back for an A/B.
ATOMIC_SEM_ENV = "MOESTREAM_PREFILL_ATOMIC_SEM"
ATOMIC_SEMS = ("relaxed", "acq_rel")


def atomic_sem() -> str:
    """The down launches' atomic semantics: $MOESTREAM_PREFILL_ATOMIC_SEM, else "relaxed"."""
    sem = os.environ.get(ATOMIC_SEM_ENV) or "relaxed"
    if sem not in ATOMIC_SEMS:
        raise ValueError(f"{ATOMIC_SEM_ENV}={sem!r}: one of {', '.join(ATOMIC_SEMS)}")
    return sem


# The rega path (kernels/expert_prefill_rega_gluon.py): NVFP4 decoded into wgmma's register operand, sm_90 only.
# Session 40 (H100, 32 experts, bench/NOTES.md), the kernels alone, % of the bf16 GEMM: 46-52 % at 256 rows an expert
# against the dequantized path's 19-28 %; 54-60 % at 1,024 against 52-53 % (with x's permutation and the table:
# 46-49 %). It reads each weight once per REGA_TILE_ROWS rows of an expert, so weights read zero-copy over the bus
# take it only while every expert of the launch has at most that many rows; weights in device memory (staged, the
# ahead slots, VRAM) up to REGA_RESIDENT_MAX_ROWS. MOESTREAM_PREFILL_REGA=0 (read per launch) turns it off.
# Routed (session 41, the engine's own launches, H100, weights in VRAM): 12 / 41 / 46 % at 64 / 256 / 512 rows an
# expert against the dequantized path's 9 / 30 / 44; at 1,024 the dequantized path keeps it (56 against 49).
REGA_ENV = "MOESTREAM_PREFILL_REGA"
REGA_TILE_ROWS = 256                # the kernels' BLOCK_M (expert_prefill_rega_gluon.TMA_CONFIG)
REGA_RESIDENT_MAX_ROWS = 512


def rega_able(x_sorted: torch.Tensor, geom: ExpertGeometry) -> bool:
    """Whether the rega path's Gluon kernels can take this launch: x on an sm_90 device (wgmma, TMA), NVFP4 experts
    with L and I multiples of 16, and $MOESTREAM_PREFILL_REGA not "0"."""
    raw = os.environ.get(REGA_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{REGA_ENV}={raw!r}: expected 0 or 1")
    return (raw == "1" and x_sorted.is_cuda and _capability(x_sorted.device.index) == (9, 0)
            and geom.fmt == "nvfp4" and geom.L % 16 == 0 and geom.I % 16 == 0)


def rega_rows(resident: bool = False) -> int:
    """The rows an expert may have in a launch that runs the rega path: one tile (REGA_TILE_ROWS: weights read where
    they lie cross the bus once), or REGA_RESIDENT_MAX_ROWS where the blocks lie in device memory. The engine splits a
    layer's launches by it (`gpu_worker.prefill_knobs.layer_limits`: the rega ones are charged no scratch)."""
    return REGA_RESIDENT_MAX_ROWS if resident else REGA_TILE_ROWS


def rega_takes(x: torch.Tensor, max_rows: int, geom: ExpertGeometry, resident: bool = False) -> bool:
    """Whether a launch whose routed experts have at most `max_rows` rows each runs the rega path (`grouped_path`):
    within `rega_rows`, on a device `rega_able` takes."""
    return 0 < max_rows <= rega_rows(resident) and rega_able(x, geom)


_FUSED_KEYS = ("X_LOAD", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
_DEQUANT_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def regroup_chunk(geom: ExpertGeometry) -> int:
    """Experts per fused launch of a sub-grouped store (their regrouped down sections within REGROUP_SCRATCH_BYTES)."""
    return max(1, REGROUP_SCRATCH_BYTES // regrouped_bytes(geom))


def tile_table(segments: list[tuple[int, int]], block_m: int) -> list[tuple[int, int, int]]:
    """(expert index, first row, end row) of every BLOCK_M tile of the experts' row segments (start, count)."""
    return [(i, m0, start + n) for i, (start, n) in enumerate(segments) for m0 in range(start, start + n, block_m)]


def grouped_path(x_sorted: torch.Tensor, segments: list[tuple[int, int]], geom: ExpertGeometry,
                 path: str = "auto", resident: bool = False) -> str:
    """"rega", "dequant" or "fused": the one `expert_prefill_grouped` runs. rega (`rega_able`: sm_90) where every
    routed expert has at most REGA_TILE_ROWS rows (weights read where they lie, one tile an expert), or
    REGA_RESIDENT_MAX_ROWS with `resident` weights (device memory: a second tile re-reads VRAM, not the bus).
    Otherwise the dequantized path multiplies x as bf16 and pays its decode (~4 µs per Super expert) back from ~32
    rows per expert, and the fused path takes fewer. Every path takes a store split into down sub-groups: the GEMMs
    read 16-neuron groups, so the launch regroups its experts' down sections first."""
    if path not in ("auto", "fused", "dequant", "rega"):
        raise ValueError(f"path={path!r}: one of auto, fused, dequant, rega")
    able = x_sorted.dtype == torch.bfloat16
    if path == "dequant" and not able:
        raise ValueError(f"the dequantized path needs bf16 x (x {x_sorted.dtype})")
    if path != "auto":
        return path
    live = [n for _, n in segments if n > 0]
    if live and rega_takes(x_sorted, max(live), geom, resident):
        return "rega"
    return "dequant" if able and live and sum(live) >= DEQUANT_MIN_TOKENS * len(live) else "fused"


def dequant_config(segments: list[tuple[int, int]]) -> dict:
    """The dequantized path's GEMM config for a launch: TMA operands from DEQUANT_TMA_MIN_TOKENS mean rows per
    routed expert on in a launch of DEQUANT_TMA_MIN_EXPERTS routed experts or more, pointer loads otherwise."""
    live = [n for _, n in segments if n > 0]
    raw = os.environ.get(DEQUANT_TMA_ENV, "")
    if raw and not raw.isdigit():
        raise ValueError(f"{DEQUANT_TMA_ENV}={raw!r}: a whole number of rows per expert")
    big = (len(live) >= DEQUANT_TMA_MIN_EXPERTS
           and sum(live) >= (int(raw) if raw else DEQUANT_TMA_MIN_TOKENS) * len(live))
    return dict(DEQUANT_TMA_CONFIG if big else DEQUANT_CONFIG)


def block_reads(segments: list[tuple[int, int]], geom: ExpertGeometry, x_sorted: torch.Tensor,
                config: dict | None = None, path: str = "auto", resident: bool = False) -> int:
    """How many expert blocks a launch reads from where they lie (once per expert dequantized, once per tile of
    BLOCK_M rows fused, of REGA_TILE_ROWS rows on the rega path): the bytes over the bus of a zero-copy launch are
    this times geom.block_bytes."""
    chosen = grouped_path(x_sorted, segments, geom, path, resident)
    if chosen == "dequant":
        return sum(1 for _, n in segments if n > 0)
    bm = REGA_TILE_ROWS if chosen == "rega" else {**GROUPED_CONFIG, **(config or {})}["BLOCK_M"]
    return sum(-(-n // bm) for _, n in segments)


def expert_prefill_grouped(x_sorted: torch.Tensor, segments: list[tuple[int, int]], addrs: list[int],
                           geom: ExpertGeometry, up_global: torch.Tensor, down_global: torch.Tensor,
                           w_sorted: torch.Tensor, tok_sorted: torch.Tensor, acc: torch.Tensor,
                           config: dict | None = None, h: torch.Tensor | None = None,
                           path: str = "auto", gs_index: list[int] | None = None,
                           resident: bool = False, x_index: torch.Tensor | None = None) -> torch.Tensor:
    """acc[tok_sorted[m]] += w_sorted[m] · down_i(relu(up_i x_sorted[m])²) for the rows m of each expert i's
    segment (start, count) of the expert-sorted rows. addrs: the experts' block addresses (host ints);
    up/down_global fp32 [n] on the device; x_sorted [M, L] bf16/fp32; w_sorted fp32 [M]; tok_sorted int64 [M];
    acc fp32 [T, L]. h: optional fp16 buffer of at least (rows of the segments) x I. No host sync.
    path (`grouped_path`; resident: the blocks lie in device memory): "rega" decodes NVFP4 into the tensor cores'
    register operand (sm_90, kernels/expert_prefill_rega_gluon.py; elsewhere, when asked for, its Triton twin),
    x permuted once (three launches); "fused" decodes NVFP4 in the GEMM's tile loop (two launches); "dequant"
    decodes each chunk of experts into a scratch first, then two GEMMs over plain loads (three or four a chunk).
    gs_index: where each expert's global scales lie in up/down_global (e.g. its expert id, with the layer's whole
    row given: no gather per launch); None: up/down_global hold the launch's experts in order.
    x_index (int64 on x's device, one per sorted row): the sorted rows are x_sorted[x_index], x_sorted being the span's
    x: the rega path gathers them as it permutes them (one pass, one launch fewer), the others gather first."""
    assert geom.fmt == "nvfp4", "the Triton expert path is NVFP4; FP8/BF16 experts use the twin"
    L = geom.L
    assert len(segments) == len(addrs)
    if gs_index is None:
        assert up_global.numel() == down_global.numel() == len(segments)
    else:
        assert len(gs_index) == len(segments) and up_global.numel() == down_global.numel()
        assert all(0 <= g < up_global.numel() for g in gs_index), "a global-scale index out of range"
    assert x_sorted.shape[1] == L and x_sorted.stride(1) == 1 and acc.shape[1] == L and acc.is_contiguous()
    assert acc.dtype == torch.float32 and w_sorted.dtype == torch.float32 and tok_sorted.dtype == torch.int64
    chosen = grouped_path(x_sorted, segments, geom, path, resident)
    if x_index is not None:
        assert x_index.dtype == torch.int64 and x_index.numel() == w_sorted.numel()
        if chosen != "rega":
            x_sorted = x_sorted.index_select(0, x_index)
    if chosen == "dequant":
        cfg = {**dequant_config(segments),
               **{k: v for k, v in (config or {}).items()
                  if k in _DEQUANT_KEYS + ("CHUNK", "TMA", "EPI_BLOCK_N")}}
        cfg["GEMM"] = expert_gemm(config) if gmm_able(x_sorted, geom) else "triton"
        return _grouped_dequant(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc,
                                cfg, h, gs_index)
    if chosen == "rega":            # its table says where each expert's scales lie: no gather
        return _grouped_rega(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, h,
                             config, gs_index, x_index)
    if gs_index is not None:        # the fused kernels index the scales by the launch's order
        idx = device_table(gs_index, up_global.device)
        up_global, down_global = up_global[idx], down_global[idx]
    cfg = {**GROUPED_CONFIG, **{k: v for k, v in (config or {}).items() if k in _FUSED_KEYS}}
    return _grouped_fused(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg, h)


def _grouped_fused(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg, h):
    L, I = geom.L, geom.I
    split = geom.down_group_neurons != GROUP
    if split and len(segments) > regroup_chunk(geom):     # the regrouped down sections within their bound
        C = regroup_chunk(geom)
        for c0 in range(0, len(segments), C):
            _grouped_fused(x_sorted, segments[c0:c0 + C], addrs[c0:c0 + C], geom, up_global[c0:c0 + C],
                           down_global[c0:c0 + C], w_sorted, tok_sorted, acc, cfg, h)
        return acc
    used = [(s, n) for s, n in segments if n > 0]
    if not used:
        return acc
    lo, hi = min(s for s, _ in used), max(s + n for s, n in used)
    # the rows of this launch, re-based so that h holds only them
    table = tile_table([(s - lo, n) for s, n in segments], cfg["BLOCK_M"])
    flat = list(chain.from_iterable(table)) + [int(a) for a in addrs]
    dev = x_sorted.device
    tab = device_table(flat, dev)
    rows = hi - lo
    if h is None or h.numel() < rows * I:
        h = torch.empty(rows * I, dtype=torch.float16, device=dev)
    grid = (triton.cdiv(I, cfg["BLOCK_N"]), len(table))
    _grouped_up_kernel[grid](x_sorted[lo:hi], tab, up_global, h, len(table), I, L, x_sorted.stride(0),
                             geom.up_scales_off, **cfg)
    down_tab, down_off = tab, geom.down_off
    if split:       # the down GEMM reads 16-neuron groups (LAYOUT 1): it reads the launch's regrouped sections
        regrouped = regroup_downs(tab[3 * len(table):], geom)     # alive until the GEMM is queued (stream order)
        nb = regrouped.shape[1]
        flat[3 * len(table):] = [regrouped.data_ptr() + i * nb for i in range(len(addrs))]
        down_tab = device_table(flat, dev)
        down_off = 0
    grid = (triton.cdiv(L, cfg["BLOCK_N"]), len(table))
    _grouped_down_kernel[grid](h, down_tab, down_global, w_sorted[lo:hi], tok_sorted[lo:hi], acc, len(table), L, I,
                               down_off, SEM=atomic_sem(), **cfg)
    return acc


def _grouped_rega(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, h,
                  config=None, gs_index=None, x_index=None):
    """The rega path: x's rows permuted to fp16 once, the tile table (with each expert's block address and where its
    global scales lie), then the up and the down (the Gluon kernels on sm_90, the Triton twin elsewhere). A split
    store's down sections are regrouped first, as the fused path's. config: the twin's tile keys (the tests' small
    tiles under the interpreter); the Gluon kernels run as measured."""
    from kernels.expert_prefill_rega import REGA_CONFIG, launch_twin, prepare
    split = geom.down_group_neurons != GROUP
    if gs_index is None:
        gs_index = list(range(len(segments)))
    if split and len(segments) > regroup_chunk(geom):     # the regrouped down sections within their bound
        C = regroup_chunk(geom)
        for c0 in range(0, len(segments), C):
            _grouped_rega(x_sorted, segments[c0:c0 + C], addrs[c0:c0 + C], geom, up_global, down_global, w_sorted,
                          tok_sorted, acc, h, config, gs_index[c0:c0 + C], x_index)
        return acc
    hopper = rega_able(x_sorted, geom)
    if hopper:          # the measured kernels as they are
        from kernels.expert_prefill_rega_gluon import TMA_CONFIG as cfg, launch_tma as launch
    else:
        cfg, launch = {**REGA_CONFIG, **{k: v for k, v in (config or {}).items() if k in REGA_CONFIG}}, launch_twin
    got = prepare(x_sorted, segments, addrs, geom, cfg["BLOCK_M"], h=h, gs_index=gs_index, x_index=x_index)
    if got is None:
        return acc
    tab, n = got[0], got[1]
    down_tab, down_off = None, None
    if split:       # the down reads 16-neuron groups: the launch's regrouped sections, their own addresses
        pairs = tab[3 * n:].view(-1, 2)
        regrouped = regroup_downs(pairs[:, 0].contiguous(), geom)     # alive until the down is queued
        at = regrouped.data_ptr() + regrouped.shape[1] * torch.arange(len(addrs), device=tab.device)
        down_tab, down_off = torch.cat([tab[:3 * n], torch.stack([at, pairs[:, 1]], 1).reshape(-1)]), 0
    return launch(*got, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg, down_tab=down_tab,
                  down_off=down_off)


# ------------------------------------------------------------------------------------------------ dequantized
# Triton's interpreter multiplies bf16 operands of tl.dot as their raw 16-bit integers (3.9: off by 1e10 on a 16 x 16
# product): there the dense GEMMs upcast their operands to fp32 first, exact for bf16 and fp16 values
_UPCAST = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(**varying("addr_ptr"))
def _dequant_kernel(addr_ptr, w_off, s_off, out_ptr, N, K, LAYOUT: tl.constexpr, OUT_BF16: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Matrix [N, K] of the block at addr_ptr[c] (c = program_id 2) decoded into out[c], row-major: e2m1 · e4m3,
    the global scale not applied, exact in bf16 and in fp16 (≤ 6 significant bits, 2^-10 ≤ |v| ≤ 2,688)."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    c = tl.program_id(2)
    base = tl.load(addr_ptr + c).to(tl.pointer_type(tl.uint8))
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    lo, hi = _nvfp4_tile_split(base + w_off, base + s_off, o_n, m_n, k0, K, N, LAYOUT, BLOCK_K)
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)).to(tl.float32) * 128.0   # undo the tile's 2^-7
    o_k = k0 + tl.arange(0, BLOCK_K)
    p = out_ptr + c.to(tl.int64) * N * K + o_n[:, None] * K + o_k[None, :]
    if OUT_BF16:
        tl.store(p, w.to(tl.bfloat16), mask=m_n[:, None] & (o_k[None, :] < K))
    else:
        tl.store(p, w.to(tl.float16), mask=m_n[:, None] & (o_k[None, :] < K))


DEQUANT_BLOCK = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4)   # 78 % of the device copy rate (H200, run 1)


def dequantize(addrs: torch.Tensor, geom: ExpertGeometry, up: torch.Tensor | None, down: torch.Tensor | None,
               down_bf16: bool = False):
    """Blocks at addrs (int64 [C] on the device) -> up[c] = [I, L] bf16 and down[c] = [L, I] fp16 (bf16 if
    down_bf16), both e2m1 · e4m3 without the global scale. Either output may be None (not decoded). A store split
    into down sub-groups has its blocks' down sections regrouped into 16-neuron groups first (one more launch)."""
    C, L, I = addrs.numel(), geom.L, geom.I
    bn, bk, nw = DEQUANT_BLOCK["BLOCK_N"], DEQUANT_BLOCK["BLOCK_K"], DEQUANT_BLOCK["num_warps"]
    if up is not None:
        assert up.dtype == torch.bfloat16 and up.numel() >= C * I * L and up.is_contiguous()
        _dequant_kernel[(triton.cdiv(I, bn), triton.cdiv(L, bk), C)](addrs, 0, geom.up_scales_off, up, I, L,
                                                                     LAYOUT=0, OUT_BF16=True, BLOCK_N=bn,
                                                                     BLOCK_K=bk, num_warps=nw)
    if down is not None:
        assert down.dtype == (torch.bfloat16 if down_bf16 else torch.float16) and down.numel() >= C * L * I
        assert down.is_contiguous()
        d_addrs, d_off = addrs, geom.down_off
        if geom.down_group_neurons != GROUP:     # LAYOUT 1 reads 16-neuron groups: regroup the sub-groups first
            regrouped = regroup_downs(addrs, geom)          # alive until the decode is queued (stream order)
            rows = torch.arange(C, dtype=torch.int64, device=addrs.device)
            d_addrs = regrouped.data_ptr() + rows * regrouped.shape[1]
            d_off = 0
        _dequant_kernel[(triton.cdiv(L, bn), triton.cdiv(I, bk), C)](d_addrs, d_off, d_off, down, L, I,
                                                                     LAYOUT=1, OUT_BF16=down_bf16, BLOCK_N=bn,
                                                                     BLOCK_K=bk, num_warps=nw)


@triton.jit
def _dense_tile(table_ptr, gs_ptr, n_tiles, n_slots):
    """Tile t of a dequantized launch: (scratch slot c, first row, end row, the slot's global scale)."""
    t = tl.program_id(1)
    c = tl.load(table_ptr + 3 * t)
    m0 = tl.load(table_ptr + 3 * t + 1)
    m1 = tl.load(table_ptr + 3 * t + 2)
    gs = tl.load(gs_ptr + tl.load(table_ptr + 3 * n_tiles + n_slots + c))
    return c, m0, m1, gs


@triton.jit
def _dense_dot(p_a, p_b, m_m, m_n, K, o_k, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ_k a[m, k] b[n, k] over K in BLOCK_K steps, fp32 [BLOCK_M, BLOCK_N] (plain pointer loads)."""
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(p_a, mask=m_m[:, None], other=0.0)
            b = tl.load(p_b, mask=m_n[:, None], other=0.0)
        else:
            m_k = (k0 + o_k)[None, :] < K
            a = tl.load(p_a, mask=m_m[:, None] & m_k, other=0.0)
            b = tl.load(p_b, mask=m_n[:, None] & m_k, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        b_acc = tl.dot(a, tl.trans(b), b_acc)
        p_a += BLOCK_K
        p_b += BLOCK_K
    return b_acc


@triton.jit
def _relu2_out(b_acc, gs, H_BF16: tl.constexpr, EMULATE: tl.constexpr):
    """The up's epilogue: relu(gs · acc)², as fp16 · 2^-8 (what the Triton down loads) or as bf16 unscaled (what
    torch._grouped_mm's down takes)."""
    b_h = tl.maximum(b_acc * gs, 0.0)
    # one return: Triton 3.6 rejects returns of two dtypes even where a constexpr picks one (the interpreter does not)
    if H_BF16:
        out = _to_bf16(b_h * b_h, EMULATE)
    else:
        out = (b_h * b_h * _X_PRESCALE).to(tl.float16)
    return out


@triton.jit(**varying("n_tiles", "n_slots"))
def _dense_up_kernel(x_ptr, table_ptr, gs_ptr, w_ptr, h_ptr, n_tiles, n_slots, I, L, stride_xm,
                     EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     H_BF16: tl.constexpr = False):
    """h[m, n] = relu(gs · Σ_k x[m, k] W_c[n, k])² · 2^-8 as fp16 (H_BF16: unscaled, bf16); W_c = w[c] bf16 [I, L]
    (c the tile's scratch slot), gs = gs_ptr[the slot's launch index], x bf16 as it is: bf16 products are exact,
    the sum fp32."""
    c, m0, m1, gs = _dense_tile(table_ptr, gs_ptr, n_tiles, n_slots)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < I
    m_m = o_m < m1
    p_x = x_ptr + o_m[:, None] * stride_xm + o_k[None, :]
    p_w = w_ptr + c.to(tl.int64) * I * L + o_n[:, None] * L + o_k[None, :]
    b_acc = _dense_dot(p_x, p_w, m_m, m_n, L, o_k, EVEN_K, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    b_h = _relu2_out(b_acc, gs, H_BF16, UPCAST)    # fp16: as the fused path stores them
    tl.store(h_ptr + o_m[:, None] * I + o_n[None, :], b_h, mask=m_m[:, None] & m_n[None, :])


@triton.jit(**varying("w_ptr", "tok_ptr", "n_tiles", "n_slots"))
def _dense_down_kernel(h_ptr, table_ptr, gs_ptr, w_ptr, tok_ptr, wd_ptr, acc_ptr, n_tiles, n_slots, L, I,
                       EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SEM: tl.constexpr = "relaxed"):
    """acc[tok[m], n] += w[m] · gs · 2^8 · Σ_k h[m, k] D_c[n, k]; D_c = wd[c] fp16 [L, I], h fp16 (· 2^-8)."""
    c, m0, m1, gs = _dense_tile(table_ptr, gs_ptr, n_tiles, n_slots)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < L
    m_m = o_m < m1
    p_h = h_ptr + o_m[:, None] * I + o_k[None, :]
    p_w = wd_ptr + c.to(tl.int64) * L * I + o_n[:, None] * I + o_k[None, :]
    b_acc = _dense_dot(p_h, p_w, m_m, m_n, I, o_k, EVEN_K, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    b_y = b_acc * (gs * 256.0) * tl.load(w_ptr + o_m, mask=m_m, other=0.0)[:, None]
    tok = tl.load(tok_ptr + o_m, mask=m_m, other=0)
    tl.atomic_add(acc_ptr + tok[:, None] * L + o_n[None, :], b_y, mask=m_m[:, None] & m_n[None, :], sem=SEM)


@triton.jit(**varying("n_tiles", "n_slots"))
def _tma_up_kernel(x_desc, table_ptr, gs_ptr, w_desc, h_ptr, n_tiles, n_slots, I, L, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, H_BF16: tl.constexpr = False):
    """`_dense_up_kernel` with both operands through the copy engine (TMA descriptors): x [rows, L], W [C·I, L].
    A tile's rows past its expert's (the next expert's rows, or zeros past the end) and its weight rows past I
    (the next slot's) only reach outputs the store masks off."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    c = tl.load(table_ptr + 3 * t).to(tl.int32)
    m0 = tl.load(table_ptr + 3 * t + 1).to(tl.int32)
    m1 = tl.load(table_ptr + 3 * t + 2)
    gs = tl.load(gs_ptr + tl.load(table_ptr + 3 * n_tiles + n_slots + c))
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        a = x_desc.load([m0, k0])
        b = w_desc.load([c * I + pid_n * BLOCK_N, k0])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        b_acc = tl.dot(a, tl.trans(b), b_acc)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    b_h = _relu2_out(b_acc, gs, H_BF16, UPCAST)
    tl.store(h_ptr + o_m[:, None] * I + o_n[None, :], b_h, mask=(o_m < m1)[:, None] & (o_n < I)[None, :])


@triton.jit(**varying("w_ptr", "tok_ptr", "n_tiles", "n_slots"))
def _tma_down_kernel(h_desc, table_ptr, gs_ptr, w_ptr, tok_ptr, wd_desc, acc_ptr, n_tiles, n_slots, L, I,
                     UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SEM: tl.constexpr = "relaxed"):
    """`_dense_down_kernel` with both operands through TMA descriptors: h [rows, I], D [C·L, I]."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    c = tl.load(table_ptr + 3 * t).to(tl.int32)
    m0 = tl.load(table_ptr + 3 * t + 1).to(tl.int32)
    m1 = tl.load(table_ptr + 3 * t + 2)
    gs = tl.load(gs_ptr + tl.load(table_ptr + 3 * n_tiles + n_slots + c))
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a = h_desc.load([m0, k0])
        b = wd_desc.load([c * L + pid_n * BLOCK_N, k0])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        b_acc = tl.dot(a, tl.trans(b), b_acc)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_m = o_m < m1
    b_y = b_acc * (gs * 256.0) * tl.load(w_ptr + o_m, mask=m_m, other=0.0)[:, None]
    tok = tl.load(tok_ptr + o_m, mask=m_m, other=0)
    tl.atomic_add(acc_ptr + tok[:, None] * L + o_n[None, :], b_y, mask=m_m[:, None] & (o_n < L)[None, :], sem=SEM)


def _tma_able(*tensors) -> bool:
    """Copy-engine descriptors need 16-byte aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def chunk_table(segments, live: list[int], addrs, block_m: int, lo: int, gs_index=None) -> list[int]:
    """One chunk's table: (scratch slot, first row - lo, end row - lo) per BLOCK_M tile of its live experts, then
    their block addresses (by slot), then where their global scales lie (by slot: their indexes into the launch, or
    gs_index[i] where given)."""
    # the segments re-based before the tiles are cut, and the tiles flattened by chain: no arithmetic or tuple per
    # tile (the nested comprehension was ~7 % of the prefill's host time at 16k, py-spy, session 16; 34 -> 24 µs a
    # 32-expert launch, and no slower on small ones, where a numpy build lost: 6 -> 15 µs at 5 experts)
    flat = list(chain.from_iterable(tile_table([(segments[i][0] - lo, segments[i][1]) for i in live], block_m)))
    flat += [int(addrs[i]) for i in live]
    flat += live if gs_index is None else [int(gs_index[i]) for i in live]
    return flat


def dense_gemms(x_sorted, n_tiles, n_slots, geom, up_w, down_w, tab, lo, hi, up_global, down_global, w_sorted,
                tok_sorted, acc, cfg, h=None, which: str = "both"):
    """The up and down GEMMs of one chunk over its decoded weights (n_slots of them), tab its chunk_table of
    n_tiles tiles, rows lo:hi of the launch; which: "up" or "down" runs that one only (the ReLU² rows in h between)."""
    L, I = geom.L, geom.I
    if h is None or h.numel() < (hi - lo) * I:
        h = torch.empty((hi - lo) * I, dtype=torch.float16, device=x_sorted.device)
    kcfg = {k: cfg[k] for k in _DEQUANT_KEYS}
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x = x_sorted[lo:hi]
    h2 = h[:(hi - lo) * I].view(hi - lo, I)
    up, down = which in ("both", "up"), which in ("both", "down")
    if cfg.get("TMA") and _tma_able(x, h2):
        from triton.tools.tensor_descriptor import TensorDescriptor as TD
        if up:
            _tma_up_kernel[(triton.cdiv(I, bn), n_tiles)](
                TD.from_tensor(x, [bm, bk]), tab, up_global, TD.from_tensor(up_w.view(-1, L), [bn, bk]), h, n_tiles,
                n_slots, I, L, UPCAST=_UPCAST, **kcfg)
        if down:
            _tma_down_kernel[(triton.cdiv(L, bn), n_tiles)](
                TD.from_tensor(h2, [bm, bk]), tab, down_global, w_sorted[lo:hi], tok_sorted[lo:hi],
                TD.from_tensor(down_w.view(-1, I), [bn, bk]), acc, n_tiles, n_slots, L, I, UPCAST=_UPCAST,
                SEM=atomic_sem(), **kcfg)
        return h
    if up:
        _dense_up_kernel[(triton.cdiv(I, bn), n_tiles)](
            x, tab, up_global, up_w, h, n_tiles, n_slots, I, L, x_sorted.stride(0),
            EVEN_K=L % bk == 0, UPCAST=_UPCAST, **kcfg)
    if down:
        _dense_down_kernel[(triton.cdiv(L, bn), n_tiles)](
            h, tab, down_global, w_sorted[lo:hi], tok_sorted[lo:hi], down_w, acc, n_tiles, n_slots, L, I,
            EVEN_K=I % bk == 0, UPCAST=_UPCAST, SEM=atomic_sem(), **kcfg)
    return h


def _chunk_launch(segments, part, addrs, block_m: int, gs_index, dev):
    """A chunk's table on the device (`chunk_table`), its tile count and its rows lo:hi of the launch."""
    lo = min(segments[i][0] for i in part)
    hi = max(segments[i][0] + segments[i][1] for i in part)
    flat = chunk_table(segments, part, addrs, block_m, lo, gs_index)
    return device_table(flat, dev), (len(flat) - 2 * len(part)) // 3, lo, hi


def _chunk_blocks(tab: torch.Tensor, n_tiles: int, n: int) -> torch.Tensor:
    """The chunk's n block addresses, as its table holds them after the tiles."""
    return tab[3 * n_tiles:3 * n_tiles + n]


def _grouped_dequant(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg, h,
                     gs_index=None):
    """Chunks of experts (the scratch within `dequant_scratch_bytes()`, or cfg CHUNK experts): decode their blocks,
    then the two GEMMs. One pinned table per chunk, copied without a sync (a pageable copy would wait for the
    stream, the run-1 variant's cost per chunk)."""
    L, I, dev = geom.L, geom.I, x_sorted.device
    live = [i for i, (_, n) in enumerate(segments) if n > 0]
    if not live:
        return acc
    if cfg.get("GEMM", "triton") != "triton":
        return _grouped_gmm(x_sorted, segments, live, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc,
                            cfg, gs_index)
    one = one_scratch()
    C = cfg.get("CHUNK") or max(1, dequant_scratch_bytes() // scratch_per_expert(L, I))
    C = min(C, len(live))
    up_w = torch.empty((C, I, L), dtype=torch.bfloat16, device=dev)
    # one scratch: the downs decoded over the ups once the up GEMM has read them (the same stream orders the two)
    down_w = up_w.view(torch.float16).view(C, L, I) if one else torch.empty((C, L, I), dtype=torch.float16,
                                                                             device=dev)
    for c0 in range(0, len(live), C):
        part = live[c0:c0 + C]
        tab, n_tiles, lo, hi = _chunk_launch(segments, part, addrs, cfg["BLOCK_M"], gs_index, dev)
        blocks = _chunk_blocks(tab, n_tiles, len(part))
        dequantize(blocks, geom, up_w, None if one else down_w)
        h = dense_gemms(x_sorted, n_tiles, len(part), geom, up_w, down_w, tab, lo, hi, up_global, down_global,
                        w_sorted, tok_sorted, acc, cfg, h, which="up" if one else "both")
        if one:                          # the downs over the ups, now that the up GEMM has read them
            dequantize(blocks, geom, None, down_w)
            dense_gemms(x_sorted, n_tiles, len(part), geom, up_w, down_w, tab, lo, hi, up_global, down_global,
                        w_sorted, tok_sorted, acc, cfg, h, which="down")
    return acc


# ------------------------------------------------------------------------------------------------ torch._grouped_mm
# MOESTREAM_EXPERT_GEMM (read per call, so that one process can A/B it; config GEMM overrides it) picks the dequantized
# path's GEMMs: "triton" (the Triton GEMMs above, the default), "grouped_mm" (both through torch._grouped_mm: CUTLASS's
# grouped GEMM on sm90/sm100), "grouped_mm_down" (the Triton up with its ReLU² epilogue, the down through
# torch._grouped_mm). torch._grouped_mm's CUTLASS path takes bf16 in and gives bf16 out only (anything else is torch's
# fallback, a loop of mm after a host sync on offs), so this path keeps h and y in bf16: transformers' own bf16
# roundings (bench/NOTES.md, session 12 h-gmm), ~4e-3 from the fp32 twin where the Triton path keeps 1e-3.
EXPERT_GEMM_ENV = "MOESTREAM_EXPERT_GEMM"
EXPERT_GEMMS = ("triton", "grouped_mm", "grouped_mm_down")
GMM_EPI_BLOCK_N = 128     # columns per program of the ReLU² and scatter kernels (rows: the table's BLOCK_M tiles)


def expert_gemm(config: dict | None = None) -> str:
    """The dequantized path's GEMMs: config GEMM, else $MOESTREAM_EXPERT_GEMM, else "triton"."""
    g = (config or {}).get("GEMM") or os.environ.get(EXPERT_GEMM_ENV) or "triton"
    if g not in EXPERT_GEMMS:
        raise ValueError(f"{EXPERT_GEMM_ENV}={g!r}: one of {', '.join(EXPERT_GEMMS)}")
    return g


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    """The device's compute capability, asked once (a launch asks for it every time)."""
    return torch.cuda.get_device_capability(index)


def gmm_able(x_sorted: torch.Tensor, geom: ExpertGeometry) -> bool:
    """Whether torch._grouped_mm's fast path takes this launch: the op exists; on CUDA an sm90/sm100 device (any
    other runs torch's fallback, which syncs the host on offs); bf16 x; every operand's base and row stride 16-byte
    aligned (x's rows and the scratch's [I, L] / [L, I] matrices: L and I multiples of 8). Else the Triton GEMMs."""
    if not hasattr(torch, "_grouped_mm") or x_sorted.dtype != torch.bfloat16:
        return False
    if x_sorted.is_cuda and _capability(x_sorted.device.index)[0] not in (9, 10):
        return False
    return (geom.L % 8 == 0 and geom.I % 8 == 0 and x_sorted.stride(0) % 8 == 0
            and x_sorted.data_ptr() % 16 == 0)


def gmm_group_ends(segments, part: list[int], lo: int, hi: int) -> list[int]:
    """torch._grouped_mm's offs for the chunk's experts `part` (sorted by first row): group j ends where expert j+1's
    rows begin, the last at hi (rows re-based to lo). Rows between two experts' segments (a launch over some experts
    only, not contiguous) fall into the group before them: computed, never scattered (the tile table skips them)."""
    return [segments[i][0] - lo for i in part[1:]] + [hi - lo]


@triton.jit(**varying("n_tiles", "n_slots"))
def _gmm_relu2_kernel(u_ptr, table_ptr, gs_ptr, n_tiles, n_slots, I, stride_um, EMULATE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """In place, on one (tile, BLOCK_N columns): u[m, n] = bf16(relu(gs · u[m, n])²), u = x W_c^T as
    torch._grouped_mm gave it (bf16, global scale not applied); the arithmetic in fp32, one rounding."""
    c, m0, m1, gs = _dense_tile(table_ptr, gs_ptr, n_tiles, n_slots)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    m = (o_m < m1)[:, None] & (o_n < I)[None, :]
    p = u_ptr + o_m.to(tl.int64)[:, None] * stride_um + o_n[None, :]
    b_u = tl.maximum(tl.load(p, mask=m, other=0.0).to(tl.float32) * gs, 0.0)
    tl.store(p, _to_bf16(b_u * b_u, EMULATE), mask=m)


@triton.jit(**varying("w_ptr", "tok_ptr", "n_tiles", "n_slots"))
def _gmm_scatter_kernel(y_ptr, table_ptr, gs_ptr, w_ptr, tok_ptr, acc_ptr, n_tiles, n_slots, L, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEM: tl.constexpr = "relaxed"):
    """acc[tok[m], n] += w[m] · gs · y[m, n] with fp32 atomics, y = h D_c^T as torch._grouped_mm gave it (bf16):
    y read once; the rows between segments (not in the tile table) never reach acc."""
    c, m0, m1, gs = _dense_tile(table_ptr, gs_ptr, n_tiles, n_slots)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_m = o_m < m1
    m = m_m[:, None] & (o_n < L)[None, :]
    b_y = tl.load(y_ptr + o_m.to(tl.int64)[:, None] * stride_ym + o_n[None, :], mask=m, other=0.0).to(tl.float32)
    b_y = b_y * (gs * tl.load(w_ptr + o_m, mask=m_m, other=0.0))[:, None]
    tok = tl.load(tok_ptr + o_m, mask=m_m, other=0)
    tl.atomic_add(acc_ptr + tok[:, None] * L + o_n[None, :], b_y, mask=m, sem=SEM)


def _grouped_gmm(x_sorted, segments, live, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg,
                 gs_index=None):
    """`_grouped_dequant` with torch._grouped_mm for the down GEMM, and for the up unless cfg GEMM is
    "grouped_mm_down" (then the Triton up, its epilogue writing bf16 h). Per chunk: one pinned table (tiles, block
    addresses, launch indexes, then the int32 offs packed two to an int64), the decode (both matrices bf16, global
    scales not applied: exact), up, ReLU² with the up's global scale (in place), down, the scatter with w · the
    down's global scale. The global scales stay out of the decoded weights: folded in, each weight would be rounded
    to bf16, an error as large as the up's output rounding."""
    L, I, dev = geom.L, geom.I, x_sorted.device
    live = sorted(live, key=lambda i: segments[i][0])       # _grouped_mm's groups follow the rows
    one = one_scratch()
    C = cfg.get("CHUNK") or max(1, dequant_scratch_bytes() // scratch_per_expert(L, I))
    C = min(C, len(live))
    triton_up = cfg["GEMM"] == "grouped_mm_down"
    up_w = torch.empty((C, I, L), dtype=torch.bfloat16, device=dev)
    # one scratch (`one_scratch`): the downs decoded over the ups after the up GEMM (the same stream orders them)
    down_w = up_w.view(C, L, I) if one else torch.empty((C, L, I), dtype=torch.bfloat16, device=dev)
    bm, bn = cfg["BLOCK_M"], cfg.get("EPI_BLOCK_N", GMM_EPI_BLOCK_N)
    for c0 in range(0, len(live), C):
        part = live[c0:c0 + C]
        n = len(part)
        lo = segments[part[0]][0]
        hi = max(segments[i][0] + segments[i][1] for i in part)
        flat = chunk_table(segments, part, addrs, bm, lo, gs_index)
        n_tiles = (len(flat) - 2 * n) // 3
        ends = gmm_group_ends(segments, part, lo, hi)
        packed = torch.tensor(ends + [0] * (n % 2), dtype=torch.int32).view(torch.int64).tolist()
        tab = device_table(flat + packed, dev)
        offs = tab[len(flat):].view(torch.int32)[:n]
        blocks = _chunk_blocks(tab, n_tiles, n)
        dequantize(blocks, geom, up_w, None if one else down_w, down_bf16=True)
        x = x_sorted[lo:hi]
        if triton_up:
            h = torch.empty((hi - lo, I), dtype=torch.bfloat16, device=dev)
            kcfg = {k: cfg[k] for k in _DEQUANT_KEYS}
            if cfg.get("TMA") and _tma_able(x, h):
                from triton.tools.tensor_descriptor import TensorDescriptor as TD
                _tma_up_kernel[(triton.cdiv(I, cfg["BLOCK_N"]), n_tiles)](
                    TD.from_tensor(x, [bm, cfg["BLOCK_K"]]), tab, up_global,
                    TD.from_tensor(up_w.view(-1, L), [cfg["BLOCK_N"], cfg["BLOCK_K"]]), h, n_tiles, n, I, L,
                    UPCAST=_UPCAST, H_BF16=True, **kcfg)
            else:
                _dense_up_kernel[(triton.cdiv(I, cfg["BLOCK_N"]), n_tiles)](
                    x, tab, up_global, up_w, h, n_tiles, n, I, L, x.stride(0), EVEN_K=L % cfg["BLOCK_K"] == 0,
                    UPCAST=_UPCAST, H_BF16=True, **kcfg)
        else:
            h = torch._grouped_mm(x, up_w[:n].transpose(1, 2), offs=offs)           # [rows, I] bf16
            _gmm_relu2_kernel[(triton.cdiv(I, bn), n_tiles)](h, tab, up_global, n_tiles, n, I, h.stride(0),
                                                             EMULATE=_UPCAST, BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
        if one:
            dequantize(blocks, geom, None, down_w, down_bf16=True)
        y = torch._grouped_mm(h, down_w[:n].transpose(1, 2), offs=offs)              # [rows, L] bf16
        _gmm_scatter_kernel[(triton.cdiv(L, bn), n_tiles)](y, tab, down_global, w_sorted[lo:hi], tok_sorted[lo:hi],
                                                           acc, n_tiles, n, L, y.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                                                           SEM=atomic_sem(), num_warps=4)
    return acc


def expert_prefill_bf16_torch(x: torch.Tensor, blk: torch.Tensor, geom: ExpertGeometry, up_global, down_global,
                              token_weights: torch.Tensor, up_bf16: bool = True) -> torch.Tensor:
    """Twin of the torch._grouped_mm path: the fp32 twin rounded to bf16 where that path rounds: u = x W^T (W without
    its global scale), h = relu(gs · u)², y = h D^T (D without its global scale); up_bf16=False keeps u in fp32
    (the "grouped_mm_down" variant's Triton up). The path's fp32 sums differ from these only in their order."""
    up = up_weight_torch(geom, blk, 1.0)
    down = down_group_weights_torch(geom, blk, 1.0).permute(1, 0, 2).reshape(geom.L, geom.I)
    u = x.float() @ up.t()
    if up_bf16:
        u = u.bfloat16().float()
    h = (torch.relu(u * float(up_global)) ** 2).bfloat16().float()
    y = (h @ down.t()).bfloat16().float()
    return y * (float(down_global) * token_weights.float())[:, None]


def expert_prefill_grouped_torch(x_sorted: torch.Tensor, segments: list[tuple[int, int]], blocks, geom,
                                 up_global, down_global, w_sorted, tok_sorted, acc, bf16: str = "") -> torch.Tensor:
    """Twin: each expert decoded from its block (U8 tensor) and applied to its segment in fp32. bf16: "" (fp32),
    or an EXPERT_GEMMS name other than "triton": rounded as that torch._grouped_mm path rounds
    (`expert_prefill_bf16_torch`)."""
    for i, (s, n) in enumerate(segments):
        if n == 0:
            continue
        xs, w, ug, dg = x_sorted[s:s + n], w_sorted[s:s + n], float(up_global[i]), float(down_global[i])
        y = (expert_prefill_bf16_torch(xs, blocks[i], geom, ug, dg, w, up_bf16=bf16 == "grouped_mm") if bf16
             else expert_prefill_torch(xs, blocks[i], geom, ug, dg, w))
        acc.index_add_(0, tok_sorted[s:s + n], y)
    return acc
