"""ReLU²-sparse down projection at decode, reading only the active 16-neuron groups.

acc[l] += Σ_j w_j · down_global_j · Σ_{g active in j} scale_jg[l] · Σ_{n<16} act[j, 16g+n] · e2m1_jg[l, n]

Each group is 9·L contiguous bytes in the block (values U8 [L, 8]: byte t of row l holds neurons 2t (low
nibble) and 2t+1 (high), then scales e4m3 [L]; docs/block-layout.md), so an active group is one contiguous
read, straight from the pinned slab (zero-copy over the bus) or from VRAM. A group whose mask is 0 is never
touched. One program takes GROUPS_PER_PROG groups of one expert, sums them in registers, and adds into acc
with fp32 atomics (relaxed: no barrier, kernels/expert_prefill.atomic_sem says why) only if one was active. A
store may split each group into sub-groups of 8, 4, 2 or 1 neurons, each with a copy of the group's scales
(`ExpertGeometry.down_group_neurons`); the kernel then reads only the sub-groups that hold a non-zero activation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.expert_block import GROUP, ExpertGeometry, block_sections
from kernels.gemv_nvfp4 import _e2m1_to_fp16
from kernels.nvfp4 import e2m1_table, fp8_to_float, unpack_codes


@triton.jit
def _sparse_down_kernel(
    # tensors
    act_ptr, mask_ptr, addr_ptr, gdown_ptr, w_ptr, acc_ptr, count_ptr,
    # sizes
    L, I, down_off,
    # config
    GROUPS_PER_PROG: tl.constexpr, BLOCK_L: tl.constexpr, COUNT: tl.constexpr,
):
    j = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_l = tl.program_id(2)
    G = I // 16
    base = tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8)) + down_off
    o_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    m_l = o_l < L
    o_t = tl.arange(0, 8)
    b_acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    n_active = 0
    for gi in range(GROUPS_PER_PROG):
        g = pid_g * GROUPS_PER_PROG + gi
        active = tl.load(mask_ptr + j * G + g, mask=g < G, other=0)
        if active != 0:
            p_g = base + g.to(tl.int64) * (9 * L)
            b_v = tl.load(p_g + o_l[:, None] * 8 + o_t[None, :], mask=m_l[:, None], other=0)
            b_s = tl.load(p_g + 8 * L + o_l, mask=m_l, other=0)
            a_even = tl.load(act_ptr + j * I + g * 16 + 2 * o_t)
            a_odd = tl.load(act_ptr + j * I + g * 16 + 2 * o_t + 1)
            lo = _e2m1_to_fp16(b_v & 15).to(tl.float32)
            hi = _e2m1_to_fp16(b_v >> 4).to(tl.float32)
            part = tl.sum(lo * a_even[None, :] + hi * a_odd[None, :], axis=1)
            b_acc += part * b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            n_active += 1
    if n_active > 0:
        coef = tl.load(w_ptr + j) * tl.load(gdown_ptr + j) * 16384.0   # 2^14 undoes the fp16 decode
        tl.atomic_add(acc_ptr + o_l, b_acc * coef, mask=m_l, sem="relaxed")
        if COUNT:
            if pid_l == 0:          # groups read (accounting of bytes over the bus): once per group, not per L tile
                tl.atomic_add(count_ptr, n_active, sem="relaxed")


@triton.jit
def _sparse_down_sub_kernel(
    act_ptr, mask_ptr, addr_ptr, gdown_ptr, w_ptr, acc_ptr, count_ptr, L, I, down_off,
    GROUPS_PER_PROG: tl.constexpr, BLOCK_L: tl.constexpr, COUNT: tl.constexpr, SUB: tl.constexpr,
):
    """A store split into down sub-groups of SUB < 16 neurons (docs/block-layout.md): sub-group s is
    L·SUB/2 bytes of codes (row l, neuron i at nibble l·SUB+i, low nibble first) then a copy of its 16-group's
    scales [L]. A sub-group is read only if its 16-group is in the mask and one of its activations is non-zero."""
    j = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_l = tl.program_id(2)
    base = tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8)) + down_off
    o_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    m_l = o_l < L
    S = I // SUB
    o_i = tl.arange(0, SUB)
    q = o_l[:, None] * SUB + o_i[None, :]                  # nibble index inside the sub-group's values
    shift = ((q % 2) * 4).to(tl.int32)
    b_acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    n_active = 0
    for si in range(GROUPS_PER_PROG):
        s = pid_g * GROUPS_PER_PROG + si
        group_on = tl.load(mask_ptr + j * (I // 16) + (s * SUB) // 16, mask=s < S, other=0)
        if group_on != 0:
            a = tl.load(act_ptr + j * I + s * SUB + o_i)
            if tl.max(tl.abs(a), axis=0) > 0:
                p_s = base + s.to(tl.int64) * (L * SUB // 2 + L)
                b_v = tl.load(p_s + q // 2, mask=m_l[:, None], other=0).to(tl.int32)
                w = _e2m1_to_fp16((b_v >> shift) & 15).to(tl.float32)
                b_sc = tl.load(p_s + L * SUB // 2 + o_l, mask=m_l, other=0)
                part = tl.sum(w * a[None, :], axis=1)
                b_acc += part * b_sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                n_active += 1
    if n_active > 0:
        coef = tl.load(w_ptr + j) * tl.load(gdown_ptr + j) * 16384.0   # 2^14 undoes the fp16 decode
        tl.atomic_add(acc_ptr + o_l, b_acc * coef, mask=m_l, sem="relaxed")
        if COUNT:
            if pid_l == 0:
                tl.atomic_add(count_ptr, n_active, sem="relaxed")


def sparse_down(act: torch.Tensor, mask: torch.Tensor, addrs: torch.Tensor, geom: ExpertGeometry,
                down_global: torch.Tensor, weights: torch.Tensor, acc: torch.Tensor,
                config: dict | None = None, counter: torch.Tensor | None = None) -> torch.Tensor:
    """act fp32 [k, I], mask int8 [k, I/16], addrs int64 [k], down_global/weights fp32 [k]; acc fp32 [L] += .
    counter: optional int32 [1] on the device, += the number of (sub-)groups read (no extra launch).
    A store split into down sub-groups (geom.down_group_neurons < 16) is read one sub-group per step."""
    assert geom.fmt == "nvfp4", "the Triton expert path is NVFP4; FP8/BF16 experts use the twin"
    L, I = geom.L, geom.I
    k = addrs.numel()
    assert act.shape == (k, I) and mask.shape == (k, I // GROUP) and acc.shape == (L,)
    assert act.is_contiguous() and mask.is_contiguous() and acc.dtype == torch.float32
    block_l = min(1024, triton.next_power_of_2(L))
    # experiment 2 (H200): from the pinned slab 4 groups per program won at 71 % and 100 % active groups
    # (587 vs 840 us) and lost 10 % at 7.5 %; from VRAM 1 per program wins everywhere (pass config=)
    cfg = {**dict(GROUPS_PER_PROG=4, BLOCK_L=block_l, num_warps=4, num_stages=1), **(config or {})}
    grid = (k, triton.cdiv(geom.n_groups, cfg["GROUPS_PER_PROG"]), triton.cdiv(L, cfg["BLOCK_L"]))
    if counter is not None:
        assert counter.dtype == torch.int32 and counter.numel() == 1
    if geom.down_group_neurons != GROUP:
        _sparse_down_sub_kernel[grid](act, mask, addrs, down_global, weights, acc,
                                      counter if counter is not None else mask, L, I, geom.down_off,
                                      COUNT=counter is not None, SUB=geom.down_group_neurons, **cfg)
        return acc
    _sparse_down_kernel[grid](act, mask, addrs, down_global, weights, acc, counter if counter is not None else mask,
                              L, I, geom.down_off, COUNT=counter is not None, **cfg)
    return acc


def down_group_weights_torch(geom: ExpertGeometry, blk: torch.Tensor, down_global) -> torch.Tensor:
    """All groups of an expert's down projection, decoded from its block: fp32 [G, L, n] (group g, row l,
    neuron n·g+i; n = geom.down_group_neurons, 16 unless the store splits groups). Written from the layout:
    values [L, n] per group as 4-bit codes, two to a byte, low nibble first, then scales [L]."""
    _, _, dv, ds = block_sections(geom, blk)
    if geom.fmt == "nvfp4":
        G, L, n = geom.n_groups, geom.L, geom.down_group_neurons
        codes = unpack_codes(dv.reshape(G, -1)).view(G, L, n)                  # n = 1: two rows per byte
        vals = e2m1_table(blk.device)[codes.long()]                            # [G, L, n]
        return vals * (fp8_to_float(ds) * float(down_global)).unsqueeze(-1)
    if geom.fmt == "fp8":
        return fp8_to_float(dv) * float(down_global)
    return dv.float()


def active_down_groups_torch(act: torch.Tensor, mask: torch.Tensor, geom: ExpertGeometry) -> torch.Tensor:
    """bool [k, G]: the stored down groups to read. mask int8 [k, I/16] marks the 16-neuron groups with a
    non-zero activation; a store split into sub-groups of n neurons reads, inside those, only the sub-groups
    that hold one."""
    per = GROUP // geom.down_group_neurons
    on = mask.to(torch.bool).repeat_interleave(per, dim=1)
    if per > 1:
        on &= (act.view(act.shape[0], geom.n_groups, geom.down_group_neurons) != 0).any(-1)
    return on


def sparse_down_torch(act: torch.Tensor, mask: torch.Tensor, blocks, geom: ExpertGeometry, down_global,
                      weights, acc: torch.Tensor) -> torch.Tensor:
    """Twin: acc fp32 [L] += Σ_j w_j Σ_{g active} W_jg · act[j, ng:ng+n], active (sub-)groups only."""
    G, n = geom.n_groups, geom.down_group_neurons
    on = active_down_groups_torch(act, mask, geom)
    for j, blk in enumerate(blocks):
        active = on[j].nonzero().flatten()
        if active.numel() == 0:
            continue
        wg = down_group_weights_torch(geom, blk, down_global[j])[active]        # [A, L, n]
        a = act[j].float().view(G, n)[active]                                  # [A, n]
        acc += float(weights[j]) * torch.einsum("gln,gn->l", wg, a)
    return acc
