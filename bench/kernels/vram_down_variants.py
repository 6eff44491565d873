"""The VRAM down decodes that lost to kernels/expert_vram.py's COMPACT (H200, bench/NOTES.md "Session 6, h24",
bench/results/moe_vram_h200_session6_run{1,2}.log), kept runnable for bench/kernels/moe_vram.py and the one-launch
layer (bench/kernels/moe_vram_layer.py):
- all groups of a program in one [groups, BLOCK_L, 8] masked load, nibble decode: 1.1-1.2x slower than QUAD where
  most groups are active (more instructions a weight);
- QUAD, the same load as int16 quads: 32.6 / 30.9 / 28.5 / 17.1 µs at 8 groups x 256 rows against COMPACT 2's
  28.8 / 24.7 / 16.7 / 7.9 at 99 / 72 / 39 / 7 % of the groups active — every lane of a program with one active group
  is decoded (issue-bound on the inactive groups' predicated lanes);
- DOT, on the tensor cores (mode 8 of the GEMV turned round): never the fastest case in run 1.
Same contract as `kernels.expert_vram.vram_down`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.expert_block import ExpertGeometry
from kernels.expert_vram import _down_rows_quad, check_down_args
from kernels.gemv_nvfp4 import _e2m1_quad, _e2m1_to_fp16

@triton.jit
def _down_rows(p_g, on, L, o_l, m_l, a_even, a_odd):
    """Σ over the groups at p_g [NG] (mask `on` [NG]) of Σ_n act[g, n] · e2m1[g, l, n] · scale[g, l], fp32
    [BLOCK_L] times 2^-14: one [NG, BLOCK_L, 8] load of the values and one [NG, BLOCK_L] of the scales.
    a_even / a_odd [NG, 8]: act at neurons 2t and 2t+1 (the low and high nibble of byte t)."""
    o_t = tl.arange(0, 8)
    m_gl = on[:, None] & m_l[None, :]
    b_v = tl.load(p_g[:, None, None] + o_l[None, :, None] * 8 + o_t[None, None, :], mask=m_gl[:, :, None], other=0)
    b_s = tl.load(p_g[:, None] + 8 * L + o_l[None, :], mask=m_gl, other=0)
    lo = _e2m1_to_fp16(b_v & 15).to(tl.float32)
    hi = _e2m1_to_fp16(b_v >> 4).to(tl.float32)
    part = tl.sum(lo * a_even[:, None, :] + hi * a_odd[:, None, :], axis=2)
    return tl.sum(part * b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32), axis=0)


@triton.jit
def _vram_down_kernel(
    act_ptr, mask_ptr, addr_ptr, gdown_ptr, w_ptr, acc_ptr, count_ptr,
    L, I, down_off,
    GROUPS_PER_PROG: tl.constexpr, BLOCK_L: tl.constexpr, COUNT: tl.constexpr, QUAD: tl.constexpr = False,
    USE_ASM: tl.constexpr = False,
):
    j = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_l = tl.program_id(2)
    G = I // 16
    # aligned: see the docstring
    base = tl.multiple_of(tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8)), 16) + down_off
    o_g = pid_g * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    on = tl.load(mask_ptr + j * G + o_g, mask=o_g < G, other=0) != 0            # [GPP]
    n_active = tl.sum(on.to(tl.int32), axis=0)
    if n_active > 0:
        o_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
        m_l = o_l < L
        p_g = base + o_g.to(tl.int64) * (9 * L)                                 # [GPP]
        # every group's values in one load: the predicated-off lanes of inactive groups fetch nothing
        if QUAD:
            p_a = act_ptr + j * I + o_g[:, None] * 16 + 4 * tl.arange(0, 4)[None, :]   # [GPP, 4]
            b_out = _down_rows_quad(p_g, on, L, o_l, m_l, tl.load(p_a, mask=on[:, None], other=0.0),
                                    tl.load(p_a + 1, mask=on[:, None], other=0.0),
                                    tl.load(p_a + 2, mask=on[:, None], other=0.0),
                                    tl.load(p_a + 3, mask=on[:, None], other=0.0), USE_ASM)
        else:
            p_a = act_ptr + j * I + o_g[:, None] * 16 + 2 * tl.arange(0, 8)[None, :]   # [GPP, 8]
            b_out = _down_rows(p_g, on, L, o_l, m_l, tl.load(p_a, mask=on[:, None], other=0.0),
                               tl.load(p_a + 1, mask=on[:, None], other=0.0))
        coef = tl.load(w_ptr + j) * tl.load(gdown_ptr + j) * 16384.0         # 2^14 undoes the fp16 decode
        tl.atomic_add(acc_ptr + o_l, b_out * coef, mask=m_l, sem="relaxed")
        if COUNT:
            if pid_l == 0:          # groups read: once per group, not per row tile
                tl.atomic_add(count_ptr, n_active, sem="relaxed")


@triton.jit
def _vram_down_dot_kernel(
    act_ptr, mask_ptr, addr_ptr, gdown_ptr, w_ptr, acc_ptr, count_ptr,
    L, I, down_off,
    GROUPS_PER_PROG: tl.constexpr, BLOCK_L: tl.constexpr, COUNT: tl.constexpr, USE_ASM: tl.constexpr,
):
    """`_vram_down_kernel` on the tensor cores, mode 8 of the GEMV turned round: per code position J, A_J [BLOCK_L,
    4·GPP] = the codes of neurons 4i + J of the program's groups (int16 quad decode), B_J [4·GPP, 16] block-diagonal
    (column g holds group g's act at 4i + J), so the product's column g is group g's sum for each row and its e4m3
    scale multiplies it once. act enters fp16 as hi + lo of act / max(act) (two dots): ~22 bits, no overflow."""
    j = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_l = tl.program_id(2)
    G = I // 16
    C: tl.constexpr = 4 * GROUPS_PER_PROG
    # aligned: see the docstring
    base = tl.multiple_of(tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8)), 16) + down_off
    o_g = pid_g * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    on = tl.load(mask_ptr + j * G + o_g, mask=o_g < G, other=0) != 0
    n_active = tl.sum(on.to(tl.int32), axis=0)
    if n_active > 0:
        o_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
        m_l = o_l < L
        o_c = tl.arange(0, C)                       # column of A / row of B: group o_c // 4, int16 o_c % 4
        g_c = pid_g * GROUPS_PER_PROG + o_c // 4
        on_c = tl.load(mask_ptr + j * G + g_c, mask=g_c < G, other=0) != 0
        p16 = (base + g_c.to(tl.int64) * (9 * L)).to(tl.pointer_type(tl.int16)) + o_c % 4
        b_h = tl.load(p16[None, :] + o_l[:, None] * 4, mask=m_l[:, None] & on_c[None, :], other=0)
        p_a = act_ptr + j * I + g_c * 16 + 4 * (o_c % 4)
        a0 = tl.load(p_a, mask=on_c, other=0.0)
        a1 = tl.load(p_a + 1, mask=on_c, other=0.0)
        a2 = tl.load(p_a + 2, mask=on_c, other=0.0)
        a3 = tl.load(p_a + 3, mask=on_c, other=0.0)
        amax = tl.maximum(tl.maximum(tl.max(a0, axis=0), tl.max(a1, axis=0)),
                          tl.maximum(tl.max(a2, axis=0), tl.max(a3, axis=0)))
        inv = 1.0 / tl.maximum(amax, 1e-30)
        o_16 = tl.arange(0, 16)
        diag = (o_c // 4)[:, None] == o_16[None, :]
        b_r = tl.zeros([BLOCK_L, 16], dtype=tl.float32)
        for J in tl.static_range(4):
            if J == 0:
                a_j = a0
            elif J == 1:
                a_j = a1
            elif J == 2:
                a_j = a2
            else:
                a_j = a3
            b_x = tl.where(diag, (a_j * inv)[:, None], 0.0)
            b_hi = b_x.to(tl.float16)
            b_lo = (b_x - b_hi.to(tl.float32)).to(tl.float16)
            a_q = _e2m1_quad(b_h, J, USE_ASM)
            b_r = tl.dot(a_q, b_hi, b_r)
            b_r = tl.dot(a_q, b_lo, b_r)
        o_gs = pid_g * GROUPS_PER_PROG + o_16
        m_gs = (o_16 < GROUPS_PER_PROG) & (o_gs < G)
        on_s = tl.load(mask_ptr + j * G + o_gs, mask=m_gs, other=0) != 0     # an inactive group's scales unread
        m_s = (m_gs & on_s)[None, :] & m_l[:, None]
        b_s = tl.load(base + o_gs.to(tl.int64)[None, :] * (9 * L) + 8 * L + o_l[:, None], mask=m_s, other=0)
        b_out = tl.sum(b_r * b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32), axis=1)
        coef = tl.load(w_ptr + j) * tl.load(gdown_ptr + j) * (16384.0 * amax)   # 2^14 undoes the fp16 decode
        tl.atomic_add(acc_ptr + o_l, b_out * coef, mask=m_l, sem="relaxed")
        if COUNT:
            if pid_l == 0:
                tl.atomic_add(count_ptr, n_active, sem="relaxed")


def vram_down_variant(act: torch.Tensor, mask: torch.Tensor, addrs: torch.Tensor, geom: ExpertGeometry,
                      down_global: torch.Tensor, weights: torch.Tensor, acc: torch.Tensor, config: dict | None = None,
                      counter: torch.Tensor | None = None) -> torch.Tensor:
    """`vram_down` with a losing decode: config QUAD (int16 quads), DOT (the tensor cores) or neither (nibbles), and
    GROUPS_PER_PROG (a power of two), BLOCK_L, num_warps, num_stages. 16-neuron down groups only."""
    if geom.down_group_neurons != 16:
        raise ValueError("the variants read 16-neuron down groups")
    check_down_args(act, mask, addrs, geom, acc, counter)
    cfg = {**dict(GROUPS_PER_PROG=8, BLOCK_L=256, num_warps=4, num_stages=1), **(config or {})}
    gpp = cfg["GROUPS_PER_PROG"]
    if gpp & (gpp - 1):
        raise ValueError(f"GROUPS_PER_PROG={gpp} must be a power of two (one load of [groups, rows, 8])")
    dot, quad = cfg.pop("DOT", False), cfg.pop("QUAD", False)
    if dot and not 4 <= gpp <= 16:
        raise ValueError(f"DOT: 4 to 16 groups a program (B has 16 columns, K = 4 x groups >= 16), got {gpp}")
    L = geom.L
    cfg["BLOCK_L"] = min(cfg["BLOCK_L"], triton.next_power_of_2(L))
    cfg.setdefault("USE_ASM", not backend.interpreted())
    grid = (addrs.numel(), triton.cdiv(geom.n_groups, gpp), triton.cdiv(L, cfg["BLOCK_L"]))
    cnt = counter if counter is not None else mask
    if dot:
        _vram_down_dot_kernel[grid](act, mask, addrs, down_global, weights, acc, cnt, L, geom.I, geom.down_off,
                                    COUNT=counter is not None, **cfg)
    else:
        _vram_down_kernel[grid](act, mask, addrs, down_global, weights, acc, cnt, L, geom.I, geom.down_off,
                                COUNT=counter is not None, QUAD=quad, **cfg)
    return acc
