"""The routed experts of one token at one MoE layer in one launch: up -> ReLU² -> 16-group mask -> sparse down.

A store of down sub-groups (8, 4 or 2 neurons, each with a copy of its 16-group's scales: ExpertGeometry
.down_group_neurons, docs/block-layout.md) is read the same way a sub-group at a time, only the sub-groups that hold
a non-zero activation (SUB; FUSED_SUBS). Sub-groups of 1 neuron (two rows a byte) keep the two launches.

acc[l] += Σ_j w_j · down_global_j · Σ_{g active in j} scale_jg[l] · Σ_{n<16} act[j, 16g+n] · e2m1_jg[l, n],
act = relu(up_j · x)². It replaces `expert_up` + `sparse_down` (kernels/moe_ops.expert_decode's two launches)
with the same inputs and result. One program takes BLOCK_N neurons (BLOCK_N / 16 down groups) of one expert:
it reads their up rows, keeps act in registers, and reads the down groups whose act is not all zero right away,
so every byte crosses the bus once and no launch boundary idles the bus between up and down (bench/NOTES.md,
issue 19). Blocks are read where they lie, by address (the pinned slab, zero-copy, or VRAM); layout:
docs/block-layout.md.

Twin: `expert_layer_torch` = the up twin, the ReLU² mask twin and the sparse-down twin in sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.expert_block import GROUP, ExpertGeometry
from kernels.expert_up import _gemv_rows_scaled, _up_rows_quad, expert_up_torch, relu2_group_mask_torch
from kernels.gemv_nvfp4 import _UNDO_DECODE, _e2m1_to_fp16
from kernels.sparse_down import sparse_down_torch


FUSED_SUBS = (16, 8, 4, 2)     # down (sub-)group sizes the one launch reads


@triton.jit
def _down_group_rows(p_g, L, o_l, m_l, a_even, a_odd, HALF: tl.constexpr = 8):
    """One down (sub-)group of 2·HALF neurons at p_g (values U8 [L, HALF], then e4m3 scales [L]) for the rows o_l:
    Σ_n act[n] · e2m1[l, n] · scale[l], fp32 [BLOCK_L], times 2^-14 (the fp16 decode's factor).
    a_even / a_odd: the group's act at neurons 2t and 2t+1 (the low and high nibble of byte t)."""
    o_t = tl.arange(0, HALF)
    b_v = tl.load(p_g + o_l[:, None] * HALF + o_t[None, :], mask=m_l[:, None], other=0)
    b_s = tl.load(p_g + HALF * L + o_l, mask=m_l, other=0)
    lo = _e2m1_to_fp16(b_v & 15).to(tl.float32)
    hi = _e2m1_to_fp16(b_v >> 4).to(tl.float32)
    part = tl.sum(lo * a_even[None, :] + hi * a_odd[None, :], axis=1)
    return part * b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _expert_layer_kernel(
    # tensors
    x_ptr, addr_ptr, up_addr_ptr, gup_ptr, gdown_ptr, w_ptr, acc_ptr, count_ptr, wait_ptr, flag_ptr, gate_ptr,
    # sizes
    L, I, up_scales_off, down_off, k,
    # config
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr, COUNT: tl.constexpr,
    UP_MODE: tl.constexpr = 4, USE_ASM: tl.constexpr = False, WAIT: tl.constexpr = False,
    SPIN_LIMIT: tl.constexpr = 1 << 20, EXPERT_MAJOR: tl.constexpr = False, SUB: tl.constexpr = 16,
    GATE: tl.constexpr = False,
):
    if EXPERT_MAJOR:
        # expert-major order (the grid is (neuron blocks, k)): the blocks are dispatched about in launch order, so
        # the caller's order (gpu_worker/up_dma.py: staged, then DMA'd in copy order, then from the slab) holds
        pid_n = tl.program_id(0)
        j = tl.load(wait_ptr + 2 * k + tl.program_id(1))
    else:
        j = tl.program_id(0)
        pid_n = tl.program_id(1)
    NG: tl.constexpr = BLOCK_N // SUB         # the (sub-)groups of this program's neurons
    HALF: tl.constexpr = SUB // 2
    base = tl.load(addr_ptr + j).to(tl.pointer_type(tl.uint8))
    if WAIT:
        # an up section still crossing by the copy engine (gpu_worker/up_dma.py): its batch's flag gets the value
        # `want` by a copy queued after the batch's copies, so seeing it (acquire: no up load moves above it)
        # means the rows are in VRAM; 0: nothing to wait for. The epochs only grow and one stream sets the flags
        # in order, so a later epoch there also means the rows are in (a later stage may set the flag first: the
        # staging's second buffer, gpu_worker/up_staging.py). A flag that never comes (a bug) must not hang the
        # device: past SPIN_LIMIT polls (~1 s; a normal wait is < 1 ms) the program goes on and counts itself in
        # flags[k], which the host reads (gpu_worker/streaming.py raises on it)
        want = tl.load(wait_ptr + j)
        if want != 0:
            f = flag_ptr + tl.load(wait_ptr + k + j)
            seen = tl.atomic_add(f, 0, sem="acquire")
            n = 0
            while (seen < want) & (n < SPIN_LIMIT):
                seen = tl.atomic_add(f, 0, sem="acquire")
                n += 1
            if seen < want:
                tl.atomic_add(flag_ptr + k, 1, sem="relaxed")
    ubase = tl.load(up_addr_ptr + j).to(tl.pointer_type(tl.uint8))    # the up rows: in the block, or staged
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    # up for this program's neurons (mode 4 or 8 of the dense GEMV), then ReLU²; act stays in registers
    if UP_MODE == 8:
        b_h = _up_rows_quad(x_ptr, ubase, ubase + up_scales_off, L, o_n, m_n, BLOCK_N, USE_ASM)
    else:
        b_h = tl.sum(_gemv_rows_scaled(x_ptr, 0, 1, ubase, ubase + up_scales_off, L, o_n, m_n, 0, L, 1, BLOCK_N,
                                       BLOCK_K), axis=1)
    b_h = b_h * (tl.load(gup_ptr + j) * _UNDO_DECODE)
    b_a = tl.maximum(b_h, 0.0)
    b_a = tl.where(m_n, b_a * b_a, 0.0)
    act = tl.reshape(b_a, (NG, SUB))
    active = tl.max((act != 0.0).to(tl.int32), axis=1)                     # [NG]: a (sub-)group with a non-zero
    n_active = tl.sum(active, axis=0)
    if n_active > 0:
        coef = tl.load(w_ptr + j) * tl.load(gdown_ptr + j) * 16384.0     # 2^14 undoes the fp16 decode
        o_r = tl.arange(0, NG)
        for l0 in range(0, L, BLOCK_L):
            o_l = l0 + tl.arange(0, BLOCK_L)
            m_l = o_l < L
            b_out = tl.zeros([BLOCK_L], dtype=tl.float32)
            for gi in tl.static_range(NG):
                if tl.sum(tl.where(o_r == gi, active, 0), axis=0) != 0:     # an all-zero group is never read
                    a_g = tl.sum(tl.where((o_r == gi)[:, None], act, 0.0), axis=0)       # [SUB]
                    a_even, a_odd = tl.split(tl.reshape(a_g, (HALF, 2)))
                    g = pid_n * NG + gi
                    p_g = base + down_off + g.to(tl.int64) * ((HALF + 1) * L)
                    b_out += _down_group_rows(p_g, L, o_l, m_l, a_even, a_odd, HALF)
            tl.atomic_add(acc_ptr + o_l, b_out * coef, mask=m_l, sem="relaxed")
        if COUNT:
            tl.atomic_add(count_ptr, n_active, sem="relaxed")
    if GATE:
        # the launch's progress (gpu_worker/up_staging.py, "progress"): gate [counter, word]; the waits' fourth row
        # holds [epoch, per mille]. The program that ends as the per-mille share of the grid has ended writes the
        # epoch into the word (a staging stream waits for it); the grid's last program puts the counter back to 0
        # for the next launch (every program has counted by then). Per mille 0: the word is never written here.
        n_prog = tl.num_programs(0) * tl.num_programs(1)
        done = tl.atomic_add(gate_ptr, 1, sem="relaxed") + 1
        permille = tl.load(wait_ptr + 3 * k + 1)
        if (permille > 0) & (done == tl.maximum((n_prog * permille) // 1000, 1)):
            tl.atomic_max(gate_ptr + 1, tl.load(wait_ptr + 3 * k), sem="release")
        if done == n_prog:
            tl.atomic_xchg(gate_ptr, 0, sem="relaxed")


def check_layer_args(x, addrs, geom: ExpertGeometry, up_global, down_global, weights, acc, counter) -> torch.Tensor:
    """A one-launch expert layer's argument checks (this kernel's and the VRAM one's,
    bench/kernels/moe_vram_layer.py); returns acc, a zeroed fp32 [L] if None."""
    L, k = geom.L, addrs.numel()
    if x.numel() != L or addrs.dtype != torch.int64:
        raise ValueError(f"x has {x.numel()} elements for L={L}; addrs must be int64, got {addrs.dtype}")
    for name, t in (("up_global", up_global), ("down_global", down_global), ("weights", weights)):
        if t.numel() != k or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [{k}], got {t.dtype} {tuple(t.shape)}")
    if acc is None:
        acc = torch.zeros(L, dtype=torch.float32, device=x.device)
    if acc.shape != (L,) or acc.dtype != torch.float32:
        raise ValueError(f"acc must be fp32 [{L}], got {acc.dtype} {tuple(acc.shape)}")
    if counter is not None and (counter.dtype != torch.int32 or counter.numel() != 1):
        raise ValueError("counter must be int32 [1]")
    return acc


def expert_layer(x: torch.Tensor, addrs: torch.Tensor, geom: ExpertGeometry, up_global: torch.Tensor,
                 down_global: torch.Tensor, weights: torch.Tensor, acc: torch.Tensor | None = None,
                 config: dict | None = None, counter: torch.Tensor | None = None,
                 up_addrs: torch.Tensor | None = None, up_ready=None, expert_major: bool = True,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
    """acc fp32 [L] (+)= Σ_j w_j · down_j(relu(up_j x)²), reading only the active down (sub-)groups: 16 neurons, or
    the store's sub-groups of 8, 4 or 2 (`geom.down_group_neurons`, FUSED_SUBS).

    The inputs of `expert_up` + `sparse_down` together: x [L] (bf16/fp32, on the device), addrs int64 [k] block
    base addresses, up_global / down_global / weights fp32 [k], acc fp32 [L] (zeros when None).
    counter: optional int32 [1], += the down (sub-)groups read (the bytes-over-the-bus accounting of sparse_down).
    up_addrs: optional int64 [k], where each expert's up section (values then scales, the block's first
    `geom.down_off` bytes) lies when it is not in the block, e.g. staged into VRAM while the dense layers ran
    (gpu_worker/up_staging.py); None: in the block.
    up_ready: optional (waits int64 [3, k], flags int64 [F > k]) for up sections that the copy engine is still moving
    while the kernel runs (gpu_worker/up_dma.py): expert j's programs read its up rows only once
    flags[waits[1, j]] == waits[0, j] (waits[0, j] == 0: no wait); waits[2]: the experts in the order their
    programs are launched (a permutation of range(k), e.g. those that wait in copy order); flags[k] counts the
    programs that gave up waiting (a flag that never came: their result is wrong, the caller must check).
    expert_major (with up_ready): the programs go in waits[2]'s order, an expert's neuron blocks together; False:
    the grid as without up_ready (every expert's first blocks first), waits[2] unused.
    waits may have a fourth row, [epoch, per mille, ...], read only with `gate`.
    gate: optional int64 [2] (counter, word; the counter 0 before the first launch): the program that ends as
    per mille / 1000 of the grid has ended writes the epoch into the word (atomic max: a staging stream waits on it,
    gpu_worker/up_staging.py "progress"), and the last one puts the counter back to 0. Needs up_ready, waits of 4 rows.
    """
    if geom.fmt != "nvfp4":
        raise ValueError(f"the fused expert kernel reads NVFP4 blocks, not {geom.fmt!r} (use the twin)")
    if geom.down_group_neurons not in FUSED_SUBS:
        raise ValueError(f"the fused expert kernel reads down groups of {FUSED_SUBS} neurons, not "
                         f"{geom.down_group_neurons} (use expert_up + sparse_down)")
    L, I = geom.L, geom.I
    k = addrs.numel()
    acc = check_layer_args(x, addrs, geom, up_global, down_global, weights, acc, counter)
    if up_addrs is None:
        up_addrs = addrs
    elif up_addrs.shape != addrs.shape or up_addrs.dtype != torch.int64:
        raise ValueError(f"up_addrs must be int64 {tuple(addrs.shape)}, got {up_addrs.dtype} {tuple(up_addrs.shape)}")
    if up_ready is not None:
        waits, flags = up_ready
        if (waits.shape not in ((3, k), (4, k)) or waits.dtype != torch.int64 or not waits.is_contiguous()
                or flags.dtype != torch.int64 or flags.dim() != 1 or flags.numel() <= k):
            raise ValueError(f"up_ready must be (int64 [3 or 4, {k}], int64 [F > {k}]), got {waits.dtype} "
                             f"{tuple(waits.shape)}, {flags.dtype} {tuple(flags.shape)}")
    if gate is not None and (up_ready is None or up_ready[0].shape != (4, k) or k < 2 or gate.dtype != torch.int64
                             or gate.numel() != 2 or gate.is_cuda != acc.is_cuda):
        raise ValueError(f"gate must be int64 [2] on the kernel's device, with up_ready's waits int64 [4, {k}] "
                         f"(k >= 2: the fourth row holds the epoch and the per mille)")
    # H200 run 1 (bench/NOTES.md, experiment 4): UP_MODE 8 at BLOCK_N 64 read the pinned slab at 83-86 % of H2D
    # (two launches: 80 %) and VRAM 1.1-1.4x faster than the two launches; BLOCK_N 128 halves the programs in flight
    cfg = {**dict(BLOCK_N=64, BLOCK_K=256, BLOCK_L=min(1024, triton.next_power_of_2(L)), num_warps=4,
                  num_stages=3, UP_MODE=8, USE_ASM=not backend.interpreted()), **(config or {})}
    if cfg["UP_MODE"] not in (4, 8):
        raise ValueError(f"UP_MODE {cfg['UP_MODE']}: 4 (scales on the tile) or 8 (int16 quad decode)")
    if cfg["BLOCK_N"] % GROUP:
        raise ValueError(f"BLOCK_N={cfg['BLOCK_N']} must hold whole 16-neuron groups")
    grid = (k, triton.cdiv(I, cfg["BLOCK_N"]))
    major = up_ready is not None and expert_major
    if major:
        grid = grid[::-1]
    waits, flags = up_ready if up_ready is not None else (addrs, addrs)
    _expert_layer_kernel[grid](x.reshape(-1).contiguous(), addrs, up_addrs, up_global, down_global, weights, acc,
                               counter if counter is not None else acc, waits, flags,
                               gate if gate is not None else flags, L, I, geom.up_scales_off,
                               geom.down_off, k, COUNT=counter is not None, WAIT=up_ready is not None,
                               EXPERT_MAJOR=major, SUB=geom.down_group_neurons, GATE=gate is not None, **cfg)
    return acc


def expert_layer_torch(x, blocks, geom: ExpertGeometry, up_global, down_global, weights, acc=None):
    """Twin: up, ReLU² + group mask, sparse down (blocks: a list of U8 tensors, one expert block each)."""
    acc = torch.zeros(geom.L, dtype=torch.float32, device=x.device) if acc is None else acc
    act, mask = relu2_group_mask_torch(expert_up_torch(x, blocks, geom, up_global))
    return sparse_down_torch(act, mask, blocks, geom, down_global, weights, acc)
