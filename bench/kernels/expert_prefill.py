"""One expert over the tokens of a prefill chunk routed to it (two tensor-core GEMMs, weights from VRAM)."""
from __future__ import annotations

import torch

from bench.kernels.common import DEV, time_graph
from kernels.expert_prefill import expert_prefill, expert_prefill_torch
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
    return rows
