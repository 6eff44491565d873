"""Grouped expert up projection at decode: the k experts of one token in one launch.

h[j, :] = up_j · x for j < k, where expert j's block starts at the address addr[j] (int64): VRAM, or the
pinned slab registered with `cudaHostRegister` (mapped; with UVA the host address is the device address),
read zero-copy. Block layout: docs/block-layout.md (up_values U8 [I, L/2] at 0, up_scales e4m3 [I, L/16]).
The ReLU² and the active 16-neuron-group mask run fused in the epilogue: act = relu(h)², mask[j, g] =
any(act[j, 16g:16g+16] != 0); the sparse down reads only the groups whose mask is set (twin:
`relu2_group_mask_torch`).
The tile math is the dense GEMV's (`_gemv_rows`: e2m1 -> fp16 by bit moves, tensor-core products, the
scale folded after each 16-group's sum).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.expert_block import GROUP, ExpertGeometry, block_sections
from kernels.gemv_nvfp4 import _UNDO_DECODE, _gemv_rows, _gemv_rows_scaled
from kernels.nvfp4 import decode_fp8, decode_nvfp4


@triton.jit
def _expert_up_kernel(
    # tensors
    x_ptr, addr_ptr, gup_ptr, out_ptr, mask_ptr,
    # sizes
    L, I, up_scales_off,
    # config
    FUSE_RELU2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOAD_MODE: tl.constexpr,
):
    j = tl.program_id(0)
    pid_n = tl.program_id(1)
    base = tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8))
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    if LOAD_MODE == 4:
        b_h = _gemv_rows_scaled(x_ptr, 0, 1, base, base + up_scales_off, L, o_n, m_n, 0, L, 1, BLOCK_N, BLOCK_K)
    else:
        b_h = _gemv_rows(x_ptr, 0, 1, base, base + up_scales_off, L // 2, L // 16, o_n, m_n, 0, L,
                         1, BLOCK_N, BLOCK_K)
    b_h = tl.sum(b_h, axis=1) * (tl.load(gup_ptr + j) * _UNDO_DECODE)
    if FUSE_RELU2:
        b_h = tl.maximum(b_h, 0.0)
        b_h = b_h * b_h
        G = I // 16
        NG: tl.constexpr = BLOCK_N // 16
        active = tl.max((b_h.reshape(NG, 16) != 0.0).to(tl.int8), axis=1)
        o_g = pid_n * NG + tl.arange(0, NG)
        tl.store(mask_ptr + j * G + o_g, active, mask=o_g < G)
    tl.store(out_ptr + j * I + o_n, b_h, mask=m_n)


def expert_up(x: torch.Tensor, addrs: torch.Tensor, geom: ExpertGeometry, up_global: torch.Tensor,
              fuse_relu2: bool = True, out: torch.Tensor | None = None, mask: torch.Tensor | None = None,
              config: dict | None = None):
    """x [L] (bf16/fp32, on the GPU), addrs int64 [k] block base addresses, up_global fp32 [k].

    Returns h fp32 [k, I] (fuse_relu2=False) or (act fp32 [k, I], mask int8 [k, I/16]).
    """
    assert geom.fmt == "nvfp4", "the Triton expert path is NVFP4; FP8/BF16 experts use the twin"
    L, I = geom.L, geom.I
    k = addrs.numel()
    assert x.numel() == L and x.is_contiguous() and addrs.dtype == torch.int64
    # experiment 2 (H200, pinned slab): mode 4 at BLOCK_N 64 read 44 GB/s = 81 % of H2D (mode 0: 75 %)
    cfg = {**dict(BLOCK_N=64, BLOCK_K=256, LOAD_MODE=4, num_warps=4, num_stages=3), **(config or {})}
    assert cfg["BLOCK_N"] % 16 == 0
    if cfg["LOAD_MODE"] not in (3, 4):
        raise ValueError(f"LOAD_MODE {cfg['LOAD_MODE']}: the up kernel runs the GEMV's modes 3 and 4")
    out = torch.empty((k, I), dtype=torch.float32, device=x.device) if out is None else out
    if fuse_relu2 and mask is None:
        mask = torch.empty((k, I // 16), dtype=torch.int8, device=x.device)
    grid = (k, triton.cdiv(I, cfg["BLOCK_N"]))
    _expert_up_kernel[grid](x, addrs, up_global, out, mask if fuse_relu2 else out, L, I, geom.up_scales_off,
                            FUSE_RELU2=fuse_relu2, **cfg)
    return (out, mask) if fuse_relu2 else out


def up_weight_torch(geom: ExpertGeometry, blk: torch.Tensor, up_global) -> torch.Tensor:
    """Expert's up projection [I, L] fp32, decoded from its block."""
    up_v, up_s, _, _ = block_sections(geom, blk)
    if geom.fmt == "nvfp4":
        return decode_nvfp4(up_v, up_s, up_global)
    if geom.fmt == "fp8":
        return decode_fp8(up_v, up_global)
    return up_v.float()


def expert_up_torch(x: torch.Tensor, blocks, geom: ExpertGeometry, up_global) -> torch.Tensor:
    """Twin: h fp32 [k, I]; blocks is a list of U8 tensors (one expert block each)."""
    xf = x.float().reshape(-1)
    return torch.stack([up_weight_torch(geom, b, up_global[j]) @ xf for j, b in enumerate(blocks)])


def relu2_group_mask_torch(h: torch.Tensor):
    """Twin of the fused epilogue: h [k, I] (I % 16 == 0) -> (act fp32 [k, I], mask int8 [k, I/16])."""
    act = torch.relu(h.float()) ** 2
    mask = (act.view(h.shape[0], -1, GROUP) != 0).any(-1).to(torch.int8)
    return act, mask
