"""ReLU² and the active 16-neuron-group mask: act = relu(h)², mask[j, g] = any(act[j, 16g:16g+16] != 0).

The sparse down projection reads only the groups whose mask is set (92.5 % of neurons are zero after ReLU²
for a given token, MISSION.md). At decode the same epilogue runs fused inside `expert_up`; this standalone
kernel serves up outputs that come from elsewhere (tests, other paths).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 16


@triton.jit
def _relu2_mask_kernel(h_ptr, act_ptr, mask_ptr, I, BLOCK_G: tl.constexpr):
    j = tl.program_id(0)
    pid = tl.program_id(1)
    G = I // 16
    o_g = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    o_n = o_g[:, None] * 16 + tl.arange(0, 16)[None, :]
    m = o_g[:, None] < G
    b_h = tl.load(h_ptr + j * I + o_n, mask=m, other=0.0).to(tl.float32)
    b_a = tl.maximum(b_h, 0.0)
    b_a = b_a * b_a
    tl.store(act_ptr + j * I + o_n, b_a, mask=m)
    active = tl.max((b_a != 0.0).to(tl.int8), axis=1)
    tl.store(mask_ptr + j * G + o_g, active, mask=o_g < G)


def relu2_group_mask(h: torch.Tensor):
    """h [k, I] (I % 16 == 0) -> (act fp32 [k, I], mask int8 [k, I/16])."""
    k, I = h.shape
    assert I % GROUP == 0 and h.is_contiguous()
    act = torch.empty((k, I), dtype=torch.float32, device=h.device)
    mask = torch.empty((k, I // GROUP), dtype=torch.int8, device=h.device)
    block_g = 64
    _relu2_mask_kernel[(k, triton.cdiv(I // GROUP, block_g))](h, act, mask, I, BLOCK_G=block_g)
    return act, mask


def relu2_group_mask_torch(h: torch.Tensor):
    act = torch.relu(h.float()) ** 2
    mask = (act.view(h.shape[0], -1, GROUP) != 0).any(-1).to(torch.int8)
    return act, mask
