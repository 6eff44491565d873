"""One whole MoE layer at decode (22 experts) vs its bytes' floor: the two launches (grouped up + fused ReLU²/mask,
then sparse down) and the fused single launch (kernels/expert_layer.py), from the pinned slab and from VRAM."""
from __future__ import annotations

import torch

from bench.kernels.common import DEV, time_graph
from bench.kernels.expert_up import addr_sets
from kernels.expert_layer import expert_layer
from kernels.moe_ops import expert_decode, expert_decode_torch
from kernels.expert_up import expert_up_torch, relu2_group_mask_torch
from kernels.testing import rel_err


# run 1 (bench/results/kernels_h200_issue19_run1.json): UP_MODE 8 BLOCK_N 64 best (now the default); BLOCK_N 128
# 44-67 % (half the programs: too few in flight); UP_MODE 4 (the old up tile) 75-85 %, 10-17 % of HBM from VRAM
# session 26-27: DOWN_PREDICATED (an inactive group's loads masked off instead of a branch per group) lost in the
# engine's decode, A/B'd in separate processes on one H100 (bench/NOTES.md session 27, call 3): 10.524 / 10.580 ms a
# token with the branch against 11.108 / 11.039 predicated, 8 MoE layers. Removed from kernels/expert_layer.py; the
# version is 76d7a43's kernels/expert_layer.py (`git show 76d7a43:kernels/expert_layer.py`)
FUSED_SWEEP = [None, dict(BLOCK_N=32), dict(UP_MODE=4)]


def run(ctx) -> list[dict]:
    geom, rows = ctx["geom"], []
    ug = torch.full((22,), 2e-3, device=DEV)
    dg = torch.full((22,), 2e-3, device=DEV)
    w = torch.rand(22, device=DEV) / 22
    x_pos = (torch.rand(geom.L, device=DEV) + 0.05).bfloat16()
    x_mixed = torch.randn(geom.L, device=DEV).bfloat16()
    n = ctx["n_per_set"]
    cases = [("natural ~50% neurons (mixed-sign x)", 0, x_mixed), ("92.5% neurons zero, independent", 0, x_pos),
             ("92.5% zero by whole groups", n, x_pos)]
    for where, src in (("pinned", ctx["slab"].tensor), ("vram", ctx["vram"])):
        ceil = 1e9 * (ctx["ceil"]["h2d_pinned_GBps"] if where == "pinned" else ctx["ceil"]["d2d_GBps"])
        for label, first, x in cases:
            sets = addr_sets(src.data_ptr(), geom, first, n)
            # the bytes this case must read: 22 ups + the active groups (from the twin's mask)
            nb_all = 0
            for s in range(8):
                idx = [first + (s * 22 + j) % n for j in range(22)]
                blocks = [src[i * geom.block_stride:][: geom.block_stride].to(DEV) for i in idx]
                _, mask = relu2_group_mask_torch(expert_up_torch(x, blocks, geom, ug))
                nb_all += 22 * geom.up_bytes + int(mask.sum()) * geom.group_bytes
                if s == 0:
                    ref = expert_decode_torch(x, blocks, geom, ug, dg, w)
                    e = rel_err(expert_decode(x, sets[0], geom, ug, dg, w, resident=False), ref)
                    ctx["checks"].append(dict(check=f"moe layer {where} {label}", rel_err=e, ok=e < 1e-5))
                    cnt = torch.zeros(1, dtype=torch.int32, device=DEV)
                    e = rel_err(expert_layer(x, sets[0], geom, ug, dg, w, counter=cnt), ref)
                    ctx["checks"].append(dict(check=f"fused moe layer {where} {label}", rel_err=e, ok=e < 1e-5))
                    n_ref = int(mask.sum())
                    ctx["checks"].append(dict(check=f"fused moe layer groups counted {where} {label}",
                                              rel_err=abs(int(cnt) - n_ref) / max(n_ref, 1), ok=int(cnt) == n_ref))
            nb = nb_all / 8
            acc = torch.zeros(geom.L, device=DEV)
            variants = [("two launches (up, sparse down)", lambda i: expert_decode(x, sets[i % 8], geom, ug, dg, w, acc,
                                                                                        resident=False))]
            for cfg in FUSED_SWEEP:
                variants.append((f"fused {cfg or 'default'}",
                                 lambda i, cfg=cfg: expert_layer(x, sets[i % 8], geom, ug, dg, w, acc, config=cfg)))
            for vlabel, fn in variants:
                sec = time_graph(fn, 8)
                rows.append(dict(op="moe layer decode", case=f"{where} {label} | {vlabel}", us=sec * 1e6, bytes=nb,
                                 GBps=nb / sec / 1e9, pct=100 * nb / sec / ceil, floor_us=nb / ceil * 1e6,
                                 vs="H2D" if where == "pinned" else "HBM"))
    return rows
