"""Grouped expert up projection at decode: the k experts of one token in one launch.

h[j, :] = up_j · x for j < k, where expert j's block starts at the address addr[j] (int64): VRAM, or the
pinned slab registered with `cudaHostRegister` (mapped; with UVA the host address is the device address),
read zero-copy. Block layout: docs/block-layout.md (up_values U8 [I, L/2] at 0, up_scales e4m3 [I, L/16]).
The ReLU² and the active 16-neuron-group mask run fused in the epilogue: act = relu(h)², mask[j, g] =
any(act[j, 16g:16g+16] != 0); the sparse down reads only the groups whose mask is set (twin:
`relu2_group_mask_torch`).
Two inner loops (LOAD_MODE): 4, the dense GEMV's former mode 4 (e2m1 -> fp16 by bit moves, the scale applied to
the tile, tensor-core products); 8, its current int16 quad decode with the block-diagonal x built in the kernel
(`_up_rows_quad`, also the fused layer kernel's up).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.expert_block import GROUP, ExpertGeometry, block_sections
from kernels.gemv_nvfp4 import _UNDO_DECODE, _X_PRESCALE, _e2m1_quad, _nvfp4_tile_split
from kernels.nvfp4 import decode_fp8, decode_nvfp4


@triton.jit
def _gemv_rows_scaled(x_ptr, stride_xm, M, w_ptr, s_ptr, K, o_n, m_n, k_lo, k_hi,
                      M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """LOAD_MODE 4 of the dense GEMV (since replaced there, bench/kernels/gemv_nvfp4_modes.py): scales applied to
    the decoded tile (exact in fp16), x.T as a plain B of 16 columns (row m of x in column m · 16/M_PAD).
    Σ_k x[m, k] · code[n, k] · scale[n, k/16] as fp32 [BLOCK_N, M_PAD] times 2^-22."""
    SPREAD: tl.constexpr = 16 // M_PAD
    o_c = tl.arange(0, 16)
    c_row = o_c // SPREAD
    m_c = ((o_c % SPREAD) == 0) & (c_row < M)
    o_j = tl.arange(0, BLOCK_K // 2)
    b_acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a_lo, a_hi = _nvfp4_tile_split(w_ptr, s_ptr, o_n, m_n, k0, K, 0, 0, BLOCK_K)
        k_e = k0 + 2 * o_j
        m_x = m_c[None, :] & (k_e[:, None] < K)
        x_e = tl.load(x_ptr + c_row[None, :] * stride_xm + k_e[:, None], mask=m_x, other=0.0)
        x_o = tl.load(x_ptr + c_row[None, :] * stride_xm + k_e[:, None] + 1, mask=m_x, other=0.0)
        b_acc = tl.dot(a_lo, (x_e.to(tl.float32) * _X_PRESCALE).to(tl.float16), b_acc)
        b_acc = tl.dot(a_hi, (x_o.to(tl.float32) * _X_PRESCALE).to(tl.float16), b_acc)
    return tl.sum(b_acc.reshape(BLOCK_N, M_PAD, SPREAD), axis=2) * (1.0 / 128.0)


@triton.jit
def _up_rows_quad(x_ptr, w_ptr, s_ptr, L, o_n, m_n, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """UP_MODE 8: the up rows by the GEMV's int16 quad decode (kernels/gemv_nvfp4.py, mode 8), the block-diagonal
    B_J built here from x (one x row; 16 groups per 256-wide tile) instead of prepared by another launch.
    fp32 [BLOCK_N] times 2^-22."""
    o_i = tl.arange(0, 64)
    o_c = tl.arange(0, 16)
    diag = (o_i[:, None] // 4) == o_c[None, :]
    w16 = w_ptr.to(tl.pointer_type(tl.int16))
    b_acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(0, L, 256):
        o_q = k0 // 4 + o_i
        m_q = o_q < L // 4
        b_h = tl.load(w16 + o_n[:, None] * (L // 4) + o_q[None, :], mask=m_n[:, None] & m_q[None, :], other=0)
        b_r = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        for J in tl.static_range(4):
            x_j = tl.load(x_ptr + 4 * o_q + J, mask=m_q, other=0.0).to(tl.float32) * _X_PRESCALE
            b_x = tl.where(diag, x_j[:, None], 0.0).to(tl.float16)
            b_r = tl.dot(_e2m1_quad(b_h, J, USE_ASM), b_x, b_r)
        o_g = k0 // 16 + o_c
        b_s = tl.load(s_ptr + o_n[:, None] * (L // 16) + o_g[None, :], mask=m_n[:, None] & (o_g[None, :] < L // 16),
                      other=0)
        b_acc += b_r * b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.sum(b_acc, axis=1)


@triton.jit
def _relu2_group_mask(b_h, m_n, mask_ptr, j, I, pid_n, BLOCK_N: tl.constexpr):
    """relu(h)² of a program's BLOCK_N neurons of expert j (0 past I), its 16-neuron groups' active flags stored in
    mask [k, I / 16] (also the VRAM layers' up, kernels/expert_vram.py)."""
    b_h = tl.maximum(b_h, 0.0)
    b_h = tl.where(m_n, b_h * b_h, 0.0)
    G = I // 16
    NG: tl.constexpr = BLOCK_N // 16
    active = tl.max((b_h.reshape(NG, 16) != 0.0).to(tl.int8), axis=1)
    o_g = pid_n * NG + tl.arange(0, NG)
    tl.store(mask_ptr + j * G + o_g, active, mask=o_g < G)
    return b_h


@triton.jit
def _expert_up_kernel(
    # tensors
    x_ptr, addr_ptr, gup_ptr, out_ptr, mask_ptr,
    # sizes
    L, I, up_scales_off,
    # config
    FUSE_RELU2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOAD_MODE: tl.constexpr,
    USE_ASM: tl.constexpr = False,
):
    j = tl.program_id(0)
    pid_n = tl.program_id(1)
    base = tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8))
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    if LOAD_MODE == 8:
        b_h = _up_rows_quad(x_ptr, base, base + up_scales_off, L, o_n, m_n, BLOCK_N, USE_ASM)
    else:
        b_h = tl.sum(_gemv_rows_scaled(x_ptr, 0, 1, base, base + up_scales_off, L, o_n, m_n, 0, L, 1, BLOCK_N,
                                       BLOCK_K), axis=1)
    b_h = b_h * (tl.load(gup_ptr + j) * _UNDO_DECODE)
    if FUSE_RELU2:
        b_h = _relu2_group_mask(b_h, m_n, mask_ptr, j, I, pid_n, BLOCK_N)
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
    if cfg["LOAD_MODE"] not in (4, 8):
        raise ValueError(f"LOAD_MODE {cfg['LOAD_MODE']}: the up kernel runs LOAD_MODE 4 or 8")
    cfg.setdefault("USE_ASM", not backend.interpreted())
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
