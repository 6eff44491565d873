"""The VRAM-resident MoE layer in ONE launch (up, ReLU², group mask, sparse down per program): an experiment that lost.

H200 run 1 (bench/NOTES.md "Session 6, h24"): 68 / 68 / 42.5 µs against the two launches' 51 / ~44 / ~27
(kernels/expert_vram.py `vram_up` + `vram_down`, the engine's): a program keeps its neurons' activations in registers
and reads their down groups itself, so the down's groups of one expert are spread over I / BLOCK_N programs with
one atomic add per row each, and the up's programs wait on their down reads. Kept here with its timings (llm.c's
habit) and its tests (tests/kernels/test_expert_vram.py); the sweep times it beside the winner.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.kernels.vram_down_variants import _down_rows
from kernels import backend
from kernels.expert_block import GROUP, ExpertGeometry
from kernels.expert_layer import check_layer_args
from kernels.expert_vram import _down_rows_quad
from kernels.gemv_nvfp4 import _UNDO_DECODE, _gemv_rows_quad, x_operands, x_pattern

FUSED_CONFIG = dict(BLOCK_N=64, BLOCK_L=256, X_BUILD=False, QUAD=True, num_warps=4, num_stages=3)


@triton.jit
def _vram_layer_kernel(
    xb_ptr, addr_ptr, gup_ptr, gdown_ptr, w_ptr, acc_ptr, count_ptr, d_ptr,
    L, I, up_scales_off, down_off, row_q, row_s, n_blocks,
    BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, X_BUILD: tl.constexpr, USE_ASM: tl.constexpr,
    COUNT: tl.constexpr, QUAD: tl.constexpr = False,
):
    """One launch: a program's BLOCK_N neurons of one expert through the mode-8 up, ReLU², then their active down
    groups (BLOCK_N / 16 of them) read BLOCK_L rows at a time, all groups of a row tile in one load."""
    pid = tl.program_id(0)
    j = pid // n_blocks
    pid_n = pid % n_blocks
    NG: tl.constexpr = BLOCK_N // 16
    base = tl.multiple_of(tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8)), 16)   # aligned: see the docstring
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    b_h = _gemv_rows_quad(xb_ptr, base, base + up_scales_off, L, row_q, row_s, o_n, m_n, 0, L, 1, BLOCK_N, 256,
                          True, USE_ASM, False, 1, 0, X_BUILD, d_ptr)
    b_h = tl.sum(b_h, axis=1) * (tl.load(gup_ptr + j) * _UNDO_DECODE)
    b_a = tl.maximum(b_h, 0.0)
    b_a = tl.where(m_n, b_a * b_a, 0.0)
    act = tl.reshape(b_a, (NG, 16))
    on = tl.max((act != 0.0).to(tl.int32), axis=1) != 0                    # [NG]
    n_active = tl.sum(on.to(tl.int32), axis=0)
    if n_active > 0:
        if QUAD:     # act[g, 4i + J] for J = 2b + c: split off c, then b
            a_c0, a_c1 = tl.split(tl.reshape(act, (NG, 4, 2, 2)))
            a0, a2 = tl.split(a_c0)
            a1, a3 = tl.split(a_c1)
        else:
            a_even, a_odd = tl.split(tl.reshape(act, (NG, 8, 2)))
        o_g = pid_n * NG + tl.arange(0, NG)
        p_g = base + down_off + o_g.to(tl.int64) * (9 * L)
        coef = tl.load(w_ptr + j) * tl.load(gdown_ptr + j) * 16384.0     # 2^14 undoes the fp16 decode
        for l0 in range(0, L, BLOCK_L):
            o_l = l0 + tl.arange(0, BLOCK_L)
            m_l = o_l < L
            if QUAD:
                b_out = _down_rows_quad(p_g, on, L, o_l, m_l, a0, a1, a2, a3, USE_ASM)
            else:
                b_out = _down_rows(p_g, on, L, o_l, m_l, a_even, a_odd)
            tl.atomic_add(acc_ptr + o_l, b_out * coef, mask=m_l, sem="relaxed")
        if COUNT:
            tl.atomic_add(count_ptr, n_active, sem="relaxed")


def vram_layer(x: torch.Tensor, addrs: torch.Tensor, geom: ExpertGeometry, up_global: torch.Tensor,
               down_global: torch.Tensor, weights: torch.Tensor, acc: torch.Tensor | None = None,
               config: dict | None = None, counter: torch.Tensor | None = None) -> torch.Tensor:
    """`vram_up` and `vram_down` in one launch (`_vram_layer_kernel`): same inputs and result. config: BLOCK_N,
    BLOCK_L, X_BUILD (else B prepared by one more launch), num_warps, num_stages."""
    if geom.fmt != "nvfp4" or geom.down_group_neurons != GROUP:
        raise ValueError("the fused VRAM kernel reads NVFP4 blocks of 16-neuron down groups")
    L, I = geom.L, geom.I
    k = addrs.numel()
    acc = check_layer_args(x, addrs, geom, up_global, down_global, weights, acc, counter)
    cfg = {**FUSED_CONFIG, **(config or {})}
    if cfg["BLOCK_N"] % GROUP:
        raise ValueError(f"BLOCK_N={cfg['BLOCK_N']} must hold whole 16-neuron groups")
    cfg["BLOCK_L"] = min(cfg["BLOCK_L"], triton.next_power_of_2(L))
    x2 = x.reshape(1, L).contiguous()
    build = cfg.pop("X_BUILD")
    xb = x2 if build else x_operands(x2, 1, True)
    d = x_pattern(x.device, 1, True, 256) if build else xb
    n_blocks = triton.cdiv(I, cfg["BLOCK_N"])
    cfg.setdefault("USE_ASM", not backend.interpreted())
    _vram_layer_kernel[(k * n_blocks,)](xb, addrs, up_global, down_global, weights, acc,
                                        counter if counter is not None else acc, d, L, I, geom.up_scales_off,
                                        geom.down_off, L // 4, L // 16, n_blocks, X_BUILD=build,
                                        COUNT=counter is not None, **cfg)
    return acc
