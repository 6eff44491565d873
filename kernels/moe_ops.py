"""The routed-expert ops the engine calls, one entry point each: the Triton kernels for NVFP4 blocks given by
address, the plain-PyTorch twins for blocks given as tensors (and for FP8/BF16 experts).

Routed experts are passed as `blocks`: on CUDA an int64 tensor [k] of block base addresses (VRAM, or the
slab registered with cudaHostRegister; see `block_addresses`), on the CPU a list of U8 tensors, one block each.
The caller's choice of form follows kernels.backend (addresses only where the kernels run).
"""
from __future__ import annotations

import torch

from kernels.expert_block import ExpertGeometry
from kernels.expert_layer import FUSED_SUBS, expert_layer
from kernels.expert_prefill import expert_prefill as _expert_prefill_triton
from kernels.expert_prefill import expert_prefill_torch
from kernels.expert_up import expert_up, expert_up_torch, relu2_group_mask_torch
from kernels.expert_vram import vram_expert_decode
from kernels.sparse_down import sparse_down, sparse_down_torch

__all__ = ["expert_decode", "expert_decode_torch", "expert_prefill", "block_addresses", "expert_layer"]


def block_addresses(blocks, device) -> torch.Tensor:
    """Base addresses of expert blocks (U8 tensors in VRAM or in registered host memory) as int64 [k]."""
    return torch.tensor([b.data_ptr() for b in blocks], dtype=torch.int64, device=device)


def _addressed(blocks) -> bool:
    return isinstance(blocks, torch.Tensor) and blocks.dtype == torch.int64


def expert_decode_torch(x, blocks, geom: ExpertGeometry, up_global, down_global, weights, acc=None):
    """Twin of the decode MoE step: acc [L] fp32 (+)= Σ_j w_j · down_j(relu(up_j x)²)."""
    acc = torch.zeros(geom.L, dtype=torch.float32, device=x.device) if acc is None else acc
    h = expert_up_torch(x, blocks, geom, up_global)
    act, mask = relu2_group_mask_torch(h)
    return sparse_down_torch(act, mask, blocks, geom, down_global, weights, acc)


def expert_decode(x, blocks, geom: ExpertGeometry, up_global, down_global, weights, acc=None,
                  up_config=None, down_config=None, down_counter=None, fused: bool = False, up_blocks=None,
                  resident: bool | None = None, up_ready=None, expert_major: bool = True, gate=None):
    """Routed experts of one token at one MoE layer. x [L]; up/down_global, weights fp32 [k].

    NVFP4 blocks by address (int64 [k]): one grouped-up launch (ReLU² and group mask fused), one sparse-down
    launch (on CPU tensors only under Triton's interpreter). Blocks as tensors, or FP8/BF16 experts: the twin.
    resident: the blocks are in VRAM (the VRAM tier's layers, device-routed or not): kernels/expert_vram.py's two
    launches tuned for HBM (up_config / down_config then configure those; bench/NOTES.md "Session 6, h24"); False:
    expert_up + sparse_down at their pinned-slab defaults. None: resident unless the call counts its down groups
    (a fused call returns before), because the engine counts down groups exactly for the blocks it reads over the bus
    (gpu_worker/streaming.py), so an uncounted, unfused call is one whose experts are in the VRAM tier.
    down_counter: int32 [1] on the device, += the down groups the kernel read (kernel path only).
    fused: one launch for the whole layer (kernels/expert_layer.py; up_config/down_config do not apply), same
    result as the two launches, for down groups of 16 neurons and sub-groups of 8, 4 and 2 (FUSED_SUBS); sub-groups
    of 1 keep the two launches.
    up_blocks: int64 [k], where each expert's up section lies when not in its block (the fused launch only).
    up_ready: (waits, flags) for up sections still crossing by the copy engine (the fused launch only;
    kernels/expert_layer.py, gpu_worker/up_dma.py); expert_major: their programs in the waits' launch order;
    gate: the launch's progress word for a staging stream (the fused launch only; kernels/expert_layer.py).
    """
    if _addressed(blocks) and geom.fmt == "nvfp4" and fused and geom.down_group_neurons in FUSED_SUBS:
        return expert_layer(x, blocks, geom, up_global, down_global, weights, acc, counter=down_counter,
                            up_addrs=up_blocks, up_ready=up_ready, expert_major=expert_major, gate=gate)
    if up_blocks is not None or up_ready is not None or gate is not None:
        raise ValueError("up sections apart from their blocks are read by the fused launch only")
    if resident is None:
        resident = down_counter is None
    if _addressed(blocks) and geom.fmt == "nvfp4" and resident:
        return vram_expert_decode(x, blocks, geom, up_global, down_global, weights, acc, up_config=up_config,
                                  down_config=down_config, counter=down_counter)
    if _addressed(blocks) and geom.fmt == "nvfp4":
        acc = torch.zeros(geom.L, dtype=torch.float32, device=x.device) if acc is None else acc
        act, mask = expert_up(x.reshape(-1).contiguous(), blocks, geom, up_global, config=up_config)
        return sparse_down(act, mask, blocks, geom, down_global, weights, acc, config=down_config,
                           counter=down_counter)
    return expert_decode_torch(x, blocks, geom, up_global, down_global, weights, acc)


def expert_prefill(x, block, geom: ExpertGeometry, up_global, down_global, token_weights):
    """One expert on the T tokens routed to it: y fp32 [T, L] = w[t] · down(relu(up x[t])²).

    CUDA: `block` is an int64 [1] address tensor (up_global/down_global fp32 [1]); CPU: a U8 tensor.
    """
    if _addressed(block) and geom.fmt == "nvfp4":
        return _expert_prefill_triton(x.contiguous(), block, 0, geom, up_global, down_global, token_weights)
    return expert_prefill_torch(x, block, geom, up_global.reshape(-1)[0], down_global.reshape(-1)[0],
                                token_weights)
