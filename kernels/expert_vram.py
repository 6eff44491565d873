"""The routed experts of one token at one MoE layer when their blocks sit in VRAM: two launches tuned for HBM.

The pinned-slab kernels (kernels/expert_up.py's defaults, kernels/sparse_down.py's, the fused kernels/expert_layer.py)
are bus-bound at 86 % of H2D and tuned for it; read from VRAM the same kernels ran at ~12 % of HBM (H200,
bench/results/profile_kernels_h200_4moe_session6_run1.log: 55 µs up + 57 µs down per Super layer against ~8 + ~3.5 µs
of bytes). At M = 1 the up of a layer's k experts is one GEMV of k · I rows over gathered block addresses with one x,
so it runs the dense GEMV's own inner loop (kernels/gemv_nvfp4.py `_gemv_rows_quad`, mode 8: int16 quad decode,
block-diagonal B, scales after the dot), with B prepared once (`x_operands`) or built per tile (X_BUILD), on a flat
grid of k · I / BLOCK_N programs; its epilogue is the ReLU² and 16-group mask of `expert_up`.
The down takes GROUPS_PER_PROG groups of one expert per program, ranks the active ones and decodes them COMPACT
at a time (int16 quad decode; an inactive group is never read), and sums them in registers before one fp32 atomic
add per row: the atomics per layer fall by GROUPS_PER_PROG against `sparse_down` at one group per program. The
decodes it beat (every group of a program in one masked load, as quads or nibbles; the tensor cores) are kept with
their timings in bench/kernels/vram_down_variants.py.

Block addresses are taken as 16-byte aligned (blocks are page aligned, expert_block.BLOCK_ALIGN; the up section
and every down group start at multiples of 16 inside them) and the kernels say so (`tl.multiple_of`): a pointer
loaded from memory has no known alignment, and without the hint Triton reads the weights 2 bytes at a time with a
64-bit address per element (the up compiled to 160 registers and 3 programs per SM instead of 94 and 5, Triton 3.9
sm_90, bench/kernels/moe_vram_sass.py).

Same inputs, outputs and accounting as `expert_up` + `sparse_down` (the down-group counter included); capturable in
a CUDA graph (no host reads; addresses from a device tensor). Twins: `expert_up_torch` / `relu2_group_mask_torch` /
`sparse_down_torch` (kernels/moe_ops.expert_decode_torch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.expert_block import GROUP, ExpertGeometry
from kernels.expert_up import _relu2_group_mask
from kernels.gemv_nvfp4 import _UNDO_DECODE, _e2m1_quad, _gemv_rows_quad, x_operands, x_pattern
from kernels.sparse_down import sparse_down

# the configurations the engine runs for VRAM-resident layers (bench/kernels/moe_vram.py, H200 runs 1-2, bench/NOTES.md
# "Session 6, h24"): the up prepared at BLOCK_N 64 won every case (19.0-19.6 us, 42 % of HBM; today's mode-4 up 55-58);
# the down COMPACT 2 at 8 groups x 256 rows won every case of run 2: 28.8 / 24.7 / 16.7 / 7.9 us at 99 / 72 / 39 / 7 %
# of groups active (today's 74 / 59 / 40 / 16; QUAD at 8 x 256 without compaction 32.6 / 30.9 / 28.5 / 17.1); two
# launches beat one everywhere (51 vs 68 us natural; the one launch is bench/kernels/moe_vram_layer.py). A store of down sub-groups keeps sparse_down's
# sub-group kernel.
UP_CONFIG = dict(BLOCK_N=64, X_BUILD=False, num_warps=4, num_stages=3)
DOWN_CONFIG = dict(GROUPS_PER_PROG=8, BLOCK_L=256, COMPACT=2, num_warps=4, num_stages=1)


@triton.jit
def _down_rows_quad(p_g, on, L, o_l, m_l, a0, a1, a2, a3, USE_ASM: tl.constexpr):
    """Σ over the groups at p_g [NG] (mask `on` [NG]) of Σ_n act[g, n] · e2m1[g, l, n] · scale[g, l], fp32
    [BLOCK_L] times 2^-14: one [NG, BLOCK_L, 4] load of the values as int16 (4 codes: neurons 4i..4i+3 of a row, low
    nibble first), decoded by the GEMV's quad PTX (2 instructions a weight where the nibble path takes ~5), and one
    [NG, BLOCK_L] of the scales. aJ [NG, 4]: act at neurons 4i + J."""
    o_i = tl.arange(0, 4)
    m_gl = on[:, None] & m_l[None, :]
    p16 = p_g.to(tl.pointer_type(tl.int16))
    b_h = tl.load(p16[:, None, None] + o_l[None, :, None] * 4 + o_i[None, None, :], mask=m_gl[:, :, None], other=0)
    b_s = tl.load(p_g[:, None] + 8 * L + o_l[None, :], mask=m_gl, other=0)
    v = _e2m1_quad(b_h, 0, USE_ASM).to(tl.float32) * a0[:, None, :]
    v += _e2m1_quad(b_h, 1, USE_ASM).to(tl.float32) * a1[:, None, :]
    v += _e2m1_quad(b_h, 2, USE_ASM).to(tl.float32) * a2[:, None, :]
    v += _e2m1_quad(b_h, 3, USE_ASM).to(tl.float32) * a3[:, None, :]
    return tl.sum(tl.sum(v, axis=2) * b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32), axis=0)


@triton.jit
def _vram_up_kernel(
    xb_ptr, addr_ptr, gup_ptr, out_ptr, mask_ptr, d_ptr,
    L, I, up_scales_off, row_q, row_s, n_blocks,
    BLOCK_N: tl.constexpr, X_BUILD: tl.constexpr, USE_ASM: tl.constexpr,
):
    pid = tl.program_id(0)
    j = pid // n_blocks                      # expert-major: one expert's row blocks are neighbours in the grid
    pid_n = pid % n_blocks
    base = tl.multiple_of(tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8)), 16)   # aligned: see the docstring
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    b_h = _gemv_rows_quad(xb_ptr, base, base + up_scales_off, L, row_q, row_s, o_n, m_n, 0, L, 1, BLOCK_N, 256,
                          True, USE_ASM, False, 1, 0, X_BUILD, d_ptr)
    b_h = tl.sum(b_h, axis=1) * (tl.load(gup_ptr + j) * _UNDO_DECODE)
    b_h = _relu2_group_mask(b_h, m_n, mask_ptr, j, I, pid_n, BLOCK_N)
    tl.store(out_ptr + j * I + o_n, b_h, mask=m_n)


@triton.jit
def _vram_down_compact_kernel(
    act_ptr, mask_ptr, addr_ptr, gdown_ptr, w_ptr, acc_ptr, count_ptr,
    L, I, down_off,
    GROUPS_PER_PROG: tl.constexpr, BLOCK_L: tl.constexpr, COUNT: tl.constexpr, USE_ASM: tl.constexpr,
    SUB: tl.constexpr,
):
    """GROUPS_PER_PROG groups of expert j per program, decoding only the active ones: they are ranked (a prefix sum of
    the mask) and taken SUB at a time in rank order, so a chunk with one active group of 16 decodes SUB groups' lanes,
    not 16 (run 1: the all-groups load, bench/kernels/vram_down_variants.py, was issue-bound on the lanes of inactive
    groups)."""
    j = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_l = tl.program_id(2)
    G = I // 16
    # aligned: see the docstring
    base = tl.multiple_of(tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8)), 16) + down_off
    o_g = pid_g * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    on = tl.load(mask_ptr + j * G + o_g, mask=o_g < G, other=0) != 0
    on_i = on.to(tl.int32)
    n_active = tl.sum(on_i, axis=0)
    if n_active > 0:
        rank = tl.cumsum(on_i, axis=0) - 1                                     # [GPP]: rank among the active
        o_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
        m_l = o_l < L
        o_s = tl.arange(0, SUB)
        o_4 = tl.arange(0, 4)
        b_out = tl.zeros([BLOCK_L], dtype=tl.float32)
        for s0 in range(0, n_active, SUB):
            slot = s0 + o_s
            hit = on[None, :] & (rank[None, :] == slot[:, None])               # [SUB, GPP]: one-hot
            g_s = tl.sum(tl.where(hit, o_g[None, :], 0), axis=1)               # the slot's group
            v_s = slot < n_active
            p_a = act_ptr + j * I + g_s[:, None] * 16 + 4 * o_4[None, :]       # [SUB, 4]
            b_out += _down_rows_quad(base + g_s.to(tl.int64) * (9 * L), v_s, L, o_l, m_l,
                                     tl.load(p_a, mask=v_s[:, None], other=0.0),
                                     tl.load(p_a + 1, mask=v_s[:, None], other=0.0),
                                     tl.load(p_a + 2, mask=v_s[:, None], other=0.0),
                                     tl.load(p_a + 3, mask=v_s[:, None], other=0.0), USE_ASM)
        coef = tl.load(w_ptr + j) * tl.load(gdown_ptr + j) * 16384.0         # 2^14 undoes the fp16 decode
        tl.atomic_add(acc_ptr + o_l, b_out * coef, mask=m_l, sem="relaxed")
        if COUNT:
            if pid_l == 0:
                tl.atomic_add(count_ptr, n_active, sem="relaxed")


def vram_up(x: torch.Tensor, addrs: torch.Tensor, geom: ExpertGeometry, up_global: torch.Tensor,
            out: torch.Tensor | None = None, mask: torch.Tensor | None = None, config: dict | None = None):
    """x [L] (bf16/fp32, on the device), addrs int64 [k], up_global fp32 [k] -> (act fp32 [k, I], mask int8
    [k, I/16]): `expert_up`'s fused ReLU² result through the dense GEMV's mode-8 loop. config: BLOCK_N (a multiple
    of 16), X_BUILD (B built per tile from x: one launch; else B prepared by `x_operands`, two), num_warps,
    num_stages."""
    if geom.fmt != "nvfp4":
        raise ValueError(f"the VRAM expert kernels read NVFP4 blocks, not {geom.fmt!r} (use the twin)")
    L, I = geom.L, geom.I
    k = addrs.numel()
    if x.numel() != L or addrs.dtype != torch.int64:
        raise ValueError(f"x has {x.numel()} elements for L={L}; addrs must be int64, got {addrs.dtype}")
    if up_global.numel() != k or up_global.dtype != torch.float32:
        raise ValueError(f"up_global must be fp32 [{k}], got {up_global.dtype} {tuple(up_global.shape)}")
    cfg = {**UP_CONFIG, **(config or {})}
    if cfg.pop("BLOCK_K", 256) != 256:
        raise ValueError("the VRAM up runs mode 8's K-tile of 256 (4 codes per int16 x 64 per row)")
    if cfg["BLOCK_N"] % GROUP:
        raise ValueError(f"BLOCK_N={cfg['BLOCK_N']} must hold whole 16-neuron groups")
    x2 = x.reshape(1, L).contiguous()
    build = cfg.pop("X_BUILD")
    xb = x2 if build else x_operands(x2, 1, True)
    d = x_pattern(x.device, 1, True, 256) if build else xb
    out = torch.empty((k, I), dtype=torch.float32, device=x.device) if out is None else out
    mask = torch.empty((k, I // GROUP), dtype=torch.int8, device=x.device) if mask is None else mask
    if out.shape != (k, I) or mask.shape != (k, I // GROUP):
        raise ValueError(f"out must be [{k}, {I}] and mask [{k}, {I // GROUP}]")
    n_blocks = triton.cdiv(I, cfg["BLOCK_N"])
    cfg.setdefault("USE_ASM", not backend.interpreted())
    _vram_up_kernel[(k * n_blocks,)](xb, addrs, up_global, out, mask, d, L, I, geom.up_scales_off, L // 4, L // 16,
                                     n_blocks, X_BUILD=build, **cfg)
    return out, mask


def check_down_args(act, mask, addrs, geom: ExpertGeometry, acc, counter) -> None:
    """The down's argument checks, shared with the losing variants (bench/kernels/vram_down_variants.py)."""
    L, I, k = geom.L, geom.I, addrs.numel()
    if act.shape != (k, I) or mask.shape != (k, I // GROUP) or acc.shape != (L,) or acc.dtype != torch.float32:
        raise ValueError(f"act must be [{k}, {I}], mask [{k}, {I // GROUP}], acc fp32 [{L}]")
    if not (act.is_contiguous() and mask.is_contiguous()):
        raise ValueError("act and mask must be contiguous")
    if counter is not None and (counter.dtype != torch.int32 or counter.numel() != 1):
        raise ValueError("counter must be int32 [1]")


def vram_down(act: torch.Tensor, mask: torch.Tensor, addrs: torch.Tensor, geom: ExpertGeometry,
              down_global: torch.Tensor, weights: torch.Tensor, acc: torch.Tensor, config: dict | None = None,
              counter: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_down`'s contract (acc fp32 [L] += the active groups' sum; counter int32 [1] += groups read) with
    GROUPS_PER_PROG (a power of two) groups of one expert per program, the active ones ranked and decoded COMPACT
    (a power of two up to GROUPS_PER_PROG) at a time. The decodes that lost to it (all groups of a program in one
    load, as int16 quads or nibbles; the tensor cores) are bench/kernels/vram_down_variants.py. A store of down
    sub-groups (geom.down_group_neurons < 16) runs sparse_down's sub-group kernel."""
    if geom.down_group_neurons != GROUP:
        return sparse_down(act, mask, addrs, geom, down_global, weights, acc, counter=counter,
                           config=dict(GROUPS_PER_PROG=1))
    check_down_args(act, mask, addrs, geom, acc, counter)
    given = config or {}
    if {"QUAD", "DOT"} & given.keys():
        raise ValueError("vram_down decodes COMPACT; the QUAD / DOT / nibble decodes lost and live in "
                         "bench/kernels/vram_down_variants.py")
    cfg = {**DOWN_CONFIG, **given}
    gpp = cfg["GROUPS_PER_PROG"]
    if gpp & (gpp - 1):
        raise ValueError(f"GROUPS_PER_PROG={gpp} must be a power of two (one load of [groups, rows, 8])")
    sub = cfg.pop("COMPACT")
    if "COMPACT" not in given:
        sub = min(sub, gpp)
    if sub < 1 or sub & (sub - 1) or sub > gpp:
        raise ValueError(f"COMPACT={sub}: a power of two up to GROUPS_PER_PROG={gpp}")
    L = geom.L
    cfg["BLOCK_L"] = min(cfg["BLOCK_L"], triton.next_power_of_2(L))
    cfg.setdefault("USE_ASM", not backend.interpreted())
    grid = (addrs.numel(), triton.cdiv(geom.n_groups, gpp), triton.cdiv(L, cfg["BLOCK_L"]))
    _vram_down_compact_kernel[grid](act, mask, addrs, down_global, weights, acc,
                                    counter if counter is not None else mask, L, geom.I, geom.down_off,
                                    COUNT=counter is not None, SUB=sub, **cfg)
    return acc


def vram_expert_decode(x, addrs, geom: ExpertGeometry, up_global, down_global, weights, acc=None,
                       up_config=None, down_config=None, counter=None) -> torch.Tensor:
    """acc fp32 [L] (+)= Σ_j w_j · down_j(relu(up_j x)²) for blocks in VRAM (int64 addresses [k]): `vram_up` then
    `vram_down`."""
    acc = torch.zeros(geom.L, dtype=torch.float32, device=x.device) if acc is None else acc
    act, mask = vram_up(x, addrs, geom, up_global, config=up_config)
    return vram_down(act, mask, addrs, geom, down_global, weights, acc, config=down_config, counter=counter)
