"""One expert on all tokens of a prefill chunk that were routed to it: two tensor-core GEMMs.

y[t, :] = w[t] · down(relu(up x[t])²) for the T tokens given; the caller scatters y into the chunk's
accumulator. The expert's block is read where it lies (VRAM or the mapped slab, by address), in the block
layout (docs/block-layout.md): up as a row-major NVFP4 matrix, down through its 16-neuron groups (LAYOUT 1
of `_nvfp4_tile_fp16`). Each weight tile is decoded once per BLOCK_M tokens, so the decode is amortised.
A store split into down sub-groups (`--down-group-neurons` < 16) has its expert's down section regrouped into
16-neuron groups in a device buffer first (one small copy kernel), then the same GEMM runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.expert_block import GROUP, ExpertGeometry
from kernels.expert_up import up_weight_torch
from kernels.gemv_nvfp4 import _nvfp4_gemm_body
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
def _regroup_down_kernel(addr_ptr, j, down_off, out_ptr, L, SUB: tl.constexpr, BLOCK_L: tl.constexpr):
    """16-neuron group g of a store split into sub-groups of SUB neurons, written in the 16-neuron layout:
    values [L, 8] (neurons 2t, 2t+1 in byte t) then the scales [L] of the group's first sub-group."""
    g = tl.program_id(0)
    o_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    m_l = o_l < L
    base = tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8)) + down_off
    o_t = tl.arange(0, 8)
    lo = _subgroup_codes(base, g, o_l, m_l, 2 * o_t, L, SUB)
    hi = _subgroup_codes(base, g, o_l, m_l, 2 * o_t + 1, L, SUB)
    out = out_ptr + g.to(tl.int64) * (9 * L)
    tl.store(out + o_l[:, None] * 8 + o_t[None, :], (lo | (hi << 4)).to(tl.uint8), mask=m_l[:, None])
    sc = tl.load(base + (g * (16 // SUB)).to(tl.int64) * (L * SUB // 2 + L) + L * SUB // 2 + o_l, mask=m_l, other=0)
    tl.store(out + 8 * L + o_l, sc, mask=m_l)


def regroup_down(addrs: torch.Tensor, j: int, geom: ExpertGeometry, block_l: int = 128) -> torch.Tensor:
    """The down section of block addrs[j] (sub-groups of geom.down_group_neurons neurons) rewritten as 16-neuron
    groups (the layout of an unsplit block's down section) into a new device buffer, U8 [I/16 · 9L]."""
    out = torch.empty(geom.n_scale_groups * 9 * geom.L, dtype=torch.uint8, device=addrs.device)
    grid = (geom.n_scale_groups, triton.cdiv(geom.L, block_l))
    _regroup_down_kernel[grid](addrs, j, geom.down_off, out, geom.L, SUB=geom.down_group_neurons, BLOCK_L=block_l)
    return out


def expert_prefill_torch(x: torch.Tensor, blk: torch.Tensor, geom: ExpertGeometry, up_global, down_global,
                         token_weights: torch.Tensor) -> torch.Tensor:
    """Twin: decode the whole expert from its block, then two matmuls in fp32."""
    up = up_weight_torch(geom, blk, up_global)                                          # [I, L]
    down = down_group_weights_torch(geom, blk, down_global).permute(1, 0, 2).reshape(geom.L, geom.I)
    a = torch.relu(x.float() @ up.t()) ** 2
    return (a @ down.t()) * token_weights.float()[:, None]
