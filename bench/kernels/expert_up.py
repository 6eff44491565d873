"""Grouped expert up for the 22 experts of a token, zero-copy from the registered slab (and from VRAM)."""
from __future__ import annotations

import torch

from bench.kernels.common import DEV, time_graph
from kernels.expert_up import expert_up, expert_up_torch
from kernels.testing import rel_err

SWEEP = [dict(), dict(LOAD_MODE=3)]  # dict() = the defaults (mode 4, BLOCK_N 64); mode 5 lost (bench/NOTES.md)


def addr_sets(base: int, geom, first: int, n: int, k: int = 22, n_sets: int = 8):
    return [torch.tensor([base + (first + (s * k + j) % n) * geom.block_stride for j in range(k)],
                         dtype=torch.int64, device=DEV) for s in range(n_sets)]


def run(ctx) -> list[dict]:
    geom, rows = ctx["geom"], []
    ug = torch.full((22,), 2e-3, device=DEV)
    x_mixed = torch.randn(geom.L, device=DEV).bfloat16()
    for where, base in (("pinned", ctx["slab"].tensor.data_ptr()), ("vram", ctx["vram"].data_ptr())):
        sets = addr_sets(base, geom, 0, ctx["n_per_set"])
        # correctness at the real size
        src = ctx["slab"].tensor if where == "pinned" else ctx["vram"]
        blocks = [src[(j % ctx["n_per_set"]) * geom.block_stride:][: geom.block_stride].to(DEV) for j in range(22)]
        act = expert_up(x_mixed, sets[0], geom, ug, fuse_relu2=False)
        e = rel_err(act, expert_up_torch(x_mixed, blocks, geom, ug))
        ctx["checks"].append(dict(check=f"expert_up 22 Super experts ({where})", rel_err=e, ok=e < 1e-5))
        ceil = 1e9 * (ctx["ceil"]["h2d_pinned_GBps"] if where == "pinned" else ctx["ceil"]["d2d_GBps"])
        nb = 22 * geom.up_bytes
        for cfg in SWEEP:
            sec = time_graph(lambda i: expert_up(x_mixed, sets[i % 8], geom, ug, config=cfg), 8)
            rows.append(dict(op="expert up x22", case=f"{where} {cfg}", us=sec * 1e6, bytes=nb, GBps=nb / sec / 1e9,
                             pct=100 * nb / sec / ceil, vs="H2D" if where == "pinned" else "HBM"))
    return rows
