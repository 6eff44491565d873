"""Routed experts at prefill, weights from VRAM: one expert per call (the first build's kernel), and the grouped
launch over 8 experts (the engine's; bench/prefill.py measures it against the ceilings, from pinned memory too)."""
from __future__ import annotations

import torch

from bench.kernels.common import DEV, time_eager, time_graph
from kernels.expert_prefill import (expert_prefill, expert_prefill_grouped, expert_prefill_grouped_torch,
                                    expert_prefill_torch)
from kernels.testing import rel_err


def run(ctx) -> list[dict]:
    geom, rows = ctx["geom"], []
    src = ctx["vram"]
    addrs = torch.tensor([src.data_ptr() + j * geom.block_stride for j in range(8)], dtype=torch.int64, device=DEV)
    ug, dg = torch.full((8,), 2e-3, device=DEV), torch.full((8,), 2e-3, device=DEV)
    for T in ctx.get("prefill_tokens", (16, 128, 512)):
        x = torch.randn(T, geom.L, device=DEV).bfloat16()
        tw = torch.rand(T, device=DEV)
        if T == ctx.get("prefill_tokens", (16, 128, 512))[min(1, len(ctx.get("prefill_tokens", (0,))) - 1)]:
            e = rel_err(expert_prefill(x, addrs, 3, geom, ug, dg, tw),
                        expert_prefill_torch(x, src[3 * geom.block_stride:][: geom.block_stride], geom, ug[3], dg[3], tw))
            ctx["checks"].append(dict(check=f"expert prefill T={T}", rel_err=e, ok=e < 2e-3))
        sec = time_graph(lambda i: expert_prefill(x, addrs, i % 8, geom, ug, dg, tw), 8)
        fl = 2 * 2 * T * geom.L * geom.I
        rows.append(dict(op="expert prefill", case=f"T={T} (vram)", us=sec * 1e6, TFLOPs=fl / sec / 1e12,
                         GBps=geom.block_bytes / sec / 1e9))
    for T in ctx.get("prefill_tokens", (16, 128, 512)):       # grouped: 8 experts of T tokens each, one launch pair
        M = 8 * T
        xs = torch.randn(M, geom.L, device=DEV).bfloat16()
        ws, tok = torch.rand(M, device=DEV), torch.arange(M, device=DEV) % max(M // 4, 1)
        acc = torch.zeros(max(M // 4, 1), geom.L, device=DEV)
        segs = [(e * T, T) for e in range(8)]
        ptrs = [src.data_ptr() + e * geom.block_stride for e in range(8)]
        blocks = [src[e * geom.block_stride:][: geom.block_stride] for e in range(8)]
        e = rel_err(expert_prefill_grouped(xs, segs, ptrs, geom, ug, dg, ws, tok, torch.zeros_like(acc)),
                    expert_prefill_grouped_torch(xs, segs, blocks, geom, ug, dg, ws, tok, torch.zeros_like(acc)))
        ctx["checks"].append(dict(check=f"grouped expert prefill 8 x T={T}", rel_err=e, ok=e < 2e-3))
        # eager: each launch copies its tile table from pinned memory, which a captured graph would replay stale
        sec = time_eager(lambda: expert_prefill_grouped(xs, segs, ptrs, geom, ug, dg, ws, tok, acc), 8)
        rows.append(dict(op="grouped expert prefill", case=f"8 experts x T={T} (vram)", us=sec * 1e6,
                         TFLOPs=8 * 2 * 2 * T * geom.L * geom.I / sec / 1e12, GBps=8 * geom.block_bytes / sec / 1e9))
    return rows
