"""The MoE router for a few rows (decode) in two launches: gate GEMV, then sigmoid, bias, group-limited top-k and
the weights; one or two routers (a layer's own and the next MoE layer's guess) on the same input in the same two.

Why: the plain-PyTorch router (`route_torch`, the twin, the math of nemotron.moe.Router) is ~15 small kernels a
router (fp32 cuBLAS GEMV, sigmoid, add, topk's gatherTopK + bitonic sort, gather, sum, divide, multiply, and the
group mask's view/topk/scatter/repeat/masked_fill when n_group > 1). A decode token runs two routers per MoE layer
(the guess for the next one): on the H200 at 4 MoE layers ~120 of a token's 260 graph nodes, ~2 µs of
kernel-to-kernel latency each (bench/results/profile_kernels_h200_4moe_session6_run1.log). At Super's 40 MoE layers
that is ~1.5-2 ms of a token.

Launch 1 (`_router_logits_kernel`): every program reads BLOCK_E gate rows over one slice of the hidden width and
writes their partial dot products (fp32) for every row of h; grid (expert blocks, K slices, routers), ~1,000
programs at Super's 512 × 4,096, so the 4 MB (bf16) or 8 MB (fp32) gate is read with all of it in flight. A bf16
gate times bf16 h is exact in fp32 per product; the sums are fp32 in a fixed order (the order differs from cuBLAS's,
which is itself unspecified: the logits agree within fp32 rounding).
Launch 2 (`_router_select_kernel`): one program per (row, router) sums the K slices in order, takes the sigmoid,
adds the score-correction bias (selection only), masks all but the topk_group best groups (a group's score: the
sum of its two best), and sorts the experts by a 64-bit key: the biased score's order-preserving bits above the
complemented expert index, so the top-k comes out in descending score order, **ties to the lower expert index**
(torch.topk leaves ties unspecified). The weights are the unbiased sigmoid scores of the chosen experts,
recomputed from the same partial sums, normalized (norm_topk_prob) and scaled.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels import backend

MAX_ROWS = 8          # the fused path's row limit (decode: 1; a few when several tokens run at once)
K_SLICE = 1024        # hidden width per program of launch 1 (4 slices at Super's 4,096)
BLOCK_E = 4           # gate rows per program of launch 1


def select_torch(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E] -> (experts int64 [T, k], weights fp32 [T, k]). Bias chooses; unbiased scores weigh."""
    E = logits.shape[-1]
    scores = torch.sigmoid(logits)
    choice = scores + bias
    if n_group > 1:
        T = logits.shape[0]
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    idx = choice.topk(k, dim=-1).indices
    w = scores.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling


def route_torch(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: h [T, H] (any float dtype) · weight [E, H] in fp32, then `select_torch`."""
    return select_torch(h.float() @ weight.float().T, bias, k, n_group, topk_group, norm_topk_prob, scaling)


@triton.jit
def _router_logits_kernel(h_ptr, w0_ptr, w1_ptr, part_ptr, M, E, H, stride_h, SPLIT,
                          M_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          K_SLICE: tl.constexpr):
    pe = tl.program_id(0)
    ps = tl.program_id(1)
    r = tl.program_id(2)
    w_ptr = w0_ptr
    if r == 1:
        w_ptr = w1_ptr
    rows = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    mr = rows < E
    ms = tl.arange(0, M_PAD)
    mm = ms < M
    acc = tl.zeros((M_PAD, BLOCK_E, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(0, K_SLICE, BLOCK_H):
        offs = ps * K_SLICE + j + tl.arange(0, BLOCK_H)
        mh = offs < H
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * H + offs[None, :], mask=mr[:, None] & mh[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(h_ptr + ms[:, None] * stride_h + offs[None, :], mask=mm[:, None] & mh[None, :],
                    other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    part = tl.sum(acc, axis=2)                                   # [M_PAD, BLOCK_E]
    base = (r * SPLIT + ps) * M
    tl.store(part_ptr + (base + ms)[:, None] * E + rows[None, :], part, mask=mm[:, None] & mr[None, :])


@triton.jit
def _router_select_kernel(part_ptr, b0_ptr, b1_ptr, ex_ptr, wt_ptr, M, E, SPLIT, scaling,
                          K: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                          G_PAD: tl.constexpr, NORM: tl.constexpr):
    m = tl.program_id(0)
    r = tl.program_id(1)
    b_ptr = b0_ptr
    if r == 1:
        b_ptr = b1_ptr
    e = tl.arange(0, E_PAD)
    me = e < E
    logit = tl.zeros((E_PAD,), dtype=tl.float32)
    for s in range(SPLIT):                                       # the K slices summed in order
        logit += tl.load(part_ptr + ((r * SPLIT + s) * M + m) * E + e, mask=me, other=0.0)
    score = 1.0 / (1.0 + tl.exp(-logit))
    choice = score + tl.load(b_ptr + e, mask=me, other=0.0)
    choice = tl.where(me, choice, float("-inf"))
    if N_GROUP > 1:
        gsize = E // N_GROUP
        grp = e // gsize
        gi = tl.arange(0, G_PAD)
        gscore = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            inside = (grp == g) & me
            c = tl.where(inside, choice, float("-inf"))
            top1 = tl.max(c, axis=0)
            i1 = tl.argmax(c, axis=0, tie_break_left=True)
            top2 = tl.max(tl.where(e == i1, float("-inf"), c), axis=0)
            gscore = tl.where(gi == g, top1 + top2, gscore)
        kept = e < 0
        for t in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, axis=0, tie_break_left=True)
            kept = kept | (grp == best)
            gscore = tl.where(gi == best, float("-inf"), gscore)
        choice = tl.where(kept, choice, float("-inf"))
    # order-preserving int32 of the float, above the complemented index: a descending sort ranks by score,
    # then by lower expert index (padding, at -inf and the highest indices, sorts last)
    bits = choice.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (ordered.to(tl.int64) << 32) | (E_PAD - 1 - e).to(tl.int64)
    key = tl.sort(key, descending=True)
    idx = E_PAD - 1 - key.to(tl.int32)                           # the low 32 bits: the complemented index
    sel = e < K                                                   # the first K of the sorted block
    idx = tl.where(sel, idx, 0)
    lsel = tl.zeros((E_PAD,), dtype=tl.float32)
    for s in range(SPLIT):                                       # the same sums, so the same scores
        lsel += tl.load(part_ptr + ((r * SPLIT + s) * M + m) * E + idx, mask=sel, other=0.0)
    w = tl.where(sel, 1.0 / (1.0 + tl.exp(-lsel)), 0.0)
    if NORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    out = (r * M + m) * K + e
    tl.store(ex_ptr + out, idx.to(tl.int64), mask=sel)
    tl.store(wt_ptr + out, w * scaling, mask=sel)


def route_rows(h: torch.Tensor, gates: Sequence[torch.Tensor], biases: Sequence[torch.Tensor], k: int,
               n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float,
               experts: torch.Tensor | None = None, weights: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, H] through R = len(gates) routers (1 or 2) with the same config: (experts int64 [R, M, k], weights
    fp32 [R, M, k]), written into `experts` / `weights` when given (static buffers of a CUDA graph)."""
    R = len(gates)
    if R not in (1, 2) or len(biases) != R:
        raise ValueError(f"route_rows: {R} gates and {len(biases)} biases, expected 1 or 2 of each")
    if h.dim() != 2:
        raise ValueError(f"route_rows: h has shape {tuple(h.shape)}, expected [rows, hidden]")
    M, H = h.shape
    E = gates[0].shape[0]
    for w, b in zip(gates, biases):
        if tuple(w.shape) != (E, H) or tuple(b.shape) != (E,):
            raise ValueError(f"route_rows: gate {tuple(w.shape)} and bias {tuple(b.shape)} for h of width {H}: "
                             f"expected [{E}, {H}] and [{E}]")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"route_rows: {E} experts in {n_group} groups, {topk_group} kept: not a valid grouping")
    if n_group > 1 and E // n_group < 2:
        raise ValueError(f"route_rows: groups of {E // n_group} expert(s); a group's score needs two")
    if not 1 <= k <= (E // n_group) * topk_group:
        raise ValueError(f"route_rows: top-{k} of {(E // n_group) * topk_group} experts in the kept groups")
    shape = (R, M, k)
    for name, t, dt in (("experts", experts, torch.int64), ("weights", weights, torch.float32)):
        if t is not None and (tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous()):
            raise ValueError(f"route_rows: {name} out is {t.dtype} {tuple(t.shape)}, expected contiguous {dt} "
                             f"{shape}")
    if not backend.use_triton(h, "router"):
        outs = [route_torch(h, w, b, k, n_group, topk_group, norm_topk_prob, scaling) for w, b in zip(gates, biases)]
        ex, wt = torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
        if experts is None:
            return ex, wt
        experts.copy_(ex)
        weights.copy_(wt)
        return experts, weights
    if M > MAX_ROWS:
        raise ValueError(f"route_rows: {M} rows; the fused router takes at most {MAX_ROWS} (use the GEMM router)")
    if h.stride(1) != 1:
        h = h.contiguous()
    gates = [w.contiguous() for w in gates]
    biases = [b.float().contiguous() for b in biases]
    if experts is None:
        experts = torch.empty(shape, dtype=torch.int64, device=h.device)
    if weights is None:
        weights = torch.empty(shape, dtype=torch.float32, device=h.device)
    if M == 0:
        return experts, weights
    m_pad = triton.next_power_of_2(M)
    split = triton.cdiv(H, K_SLICE)
    part = torch.empty(R, split, M, E, dtype=torch.float32, device=h.device)
    _router_logits_kernel[(triton.cdiv(E, BLOCK_E), split, R)](
        h, gates[0], gates[-1], part, M, E, H, h.stride(0), split,
        M_PAD=m_pad, BLOCK_E=BLOCK_E, BLOCK_H=max(16, K_SLICE // m_pad // 2), K_SLICE=K_SLICE, num_warps=4)
    _router_select_kernel[(M, R)](
        part, biases[0], biases[-1], experts, weights, M, E, split, float(scaling),
        K=k, E_PAD=max(16, triton.next_power_of_2(E)), N_GROUP=n_group, TOPK_GROUP=topk_group,
        G_PAD=max(2, triton.next_power_of_2(n_group)), NORM=bool(norm_topk_prob), num_warps=4)
    return experts, weights
