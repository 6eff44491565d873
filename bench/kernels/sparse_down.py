"""Sparse down for 22 experts at several group-active fractions, zero-copy from the slab (and from VRAM)."""
from __future__ import annotations

import torch

from bench.kernels.common import DEV, time_graph
from bench.kernels.expert_up import addr_sets
from kernels.sparse_down import sparse_down, sparse_down_torch
from kernels.testing import rel_err

FRACS = [("7.5% groups active", 0.075), ("71% groups (92.5% neurons zero, independent)", 1 - 0.925 ** 16),
         ("100% groups", 1.0)]


def synth_act(k, I, frac, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    G = I // 16
    mask = (torch.rand(k, G, device=DEV, generator=g) < frac).to(torch.int8)
    act = (torch.rand(k, G, 16, device=DEV, generator=g) + 0.01) * mask[..., None]
    return act.reshape(k, I).contiguous(), mask


def run(ctx) -> list[dict]:
    geom, rows = ctx["geom"], []
    dg = torch.full((22,), 2e-3, device=DEV)
    w = torch.rand(22, device=DEV) / 22
    acc = torch.zeros(geom.L, device=DEV)
    for where, base in (("pinned", ctx["slab"].tensor.data_ptr()), ("vram", ctx["vram"].data_ptr())):
        sets = addr_sets(base, geom, 0, ctx["n_per_set"])
        src = ctx["slab"].tensor if where == "pinned" else ctx["vram"]
        act, mask = synth_act(22, geom.I, 0.3, 5)
        blocks = [src[(j % ctx["n_per_set"]) * geom.block_stride:][: geom.block_stride].to(DEV) for j in range(22)]
        out = sparse_down(act, mask, sets[0], geom, dg, w, torch.zeros(geom.L, device=DEV))
        ref = sparse_down_torch(act, mask, blocks, geom, dg, w, torch.zeros(geom.L, device=DEV))
        e = rel_err(out, ref)
        ctx["checks"].append(dict(check=f"sparse_down 22 Super experts 30% ({where})", rel_err=e, ok=e < 1e-5))
        ceil = 1e9 * (ctx["ceil"]["h2d_pinned_GBps"] if where == "pinned" else ctx["ceil"]["d2d_GBps"])
        t_all = None
        for label, frac in reversed(FRACS):
            acts = [synth_act(22, geom.I, frac, 10 + s) for s in range(8)]
            n_act = sum(int(m.sum()) for _, m in acts) / 8
            nb = n_act * geom.group_bytes
            for gpp, bl, nw in ((1, 1024, 4), (4, 1024, 4), (1, 512, 4)):
                cfg = dict(GROUPS_PER_PROG=gpp, BLOCK_L=min(bl, ctx["geom"].L), num_warps=nw)
                gpp = f"{gpp} BLOCK_L={bl} warps={nw}"
                sec = time_graph(lambda i: sparse_down(*acts[i % 8], sets[i % 8], geom, dg, w, acc, config=cfg), 8)
                if frac == 1.0 and t_all is None:
                    t_all = sec
                rows.append(dict(op="sparse down x22", case=f"{where} {label} gpp={gpp}", us=sec * 1e6, bytes=nb,
                                 GBps=nb / sec / 1e9, pct=100 * nb / sec / ceil,
                                 vs="H2D" if where == "pinned" else "HBM",
                                 time_vs_all=sec / t_all if t_all else None))
    return rows
