"""One expert on all tokens of a prefill chunk that were routed to it: two tensor-core GEMMs.

y[t, :] = w[t] · down(relu(up x[t])²) for the T tokens given; the caller scatters y into the chunk's
accumulator. The expert's block is read where it lies (VRAM or the mapped slab, by address), in the block
layout (docs/block-layout.md): up as a row-major NVFP4 matrix, down through its 16-neuron groups (LAYOUT 1
of `_nvfp4_tile_fp16`). Each weight tile is decoded once per BLOCK_M tokens, so the decode is amortised.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.expert_block import ExpertGeometry
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
    if geom.down_group_neurons != 16:    # LAYOUT 1 of the GEMM tile reads 16-neuron groups
        raise NotImplementedError(f"the prefill kernel reads 16-neuron down groups; this store has groups of "
                                  f"{geom.down_group_neurons} (repack with --down-group-neurons 16 for CUDA prefill)")
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
    grid = (triton.cdiv(L, cfg["BLOCK_N"]), triton.cdiv(T, cfg["BLOCK_M"]))
    _expert_gemm_kernel[grid](h, addrs, j, geom.down_off, geom.down_off, down_global, y, token_weights,
                              T, L, I, h.stride(0), y.stride(0),
                              LAYOUT=1, HAS_ROW_SCALE=True, RELU2=False, **cfg)
    return y


def expert_prefill_torch(x: torch.Tensor, blk: torch.Tensor, geom: ExpertGeometry, up_global, down_global,
                         token_weights: torch.Tensor) -> torch.Tensor:
    """Twin: decode the whole expert from its block, then two matmuls in fp32."""
    up = up_weight_torch(geom, blk, up_global)                                          # [I, L]
    down = down_group_weights_torch(geom, blk, down_global).permute(1, 0, 2).reshape(geom.L, geom.I)
    a = torch.relu(x.float() @ up.t()) ** 2
    return (a @ down.t()) * token_weights.float()[:, None]
