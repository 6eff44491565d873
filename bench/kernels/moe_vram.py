"""A decode MoE layer read from VRAM (22 Super experts), variant by variant, beside the D2D ceiling (issue 19).

    python -m bench.kernels.moe_vram [--budget-s 100] [--out results.json]

The up alone, the down alone (on the act/mask the up really makes), and the pairs: today's two launches (pinned-slab
defaults: what bench/results/profile_kernels_h200_4moe_session6_run1.log measured, 55 + 57 µs), sparse_down at one
group per program (the earlier VRAM advice), the fused launch, kernels/expert_vram.py at its defaults and the best up
with the best down of this run. Activations as bench/kernels/moe_layer.py makes them: random NVFP4 experts whose up
rows carry one sign, a mixed-sign x (natural ~50 % of neurons, nearly every group active) or a positive one (92.5 %
of neurons zero, independent or by whole groups). Every variant is checked against the twin at full size first.
Kept variants and why they lost: bench/NOTES.md "Session 6, h24".
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

if not torch.cuda.is_available():       # a CPU smoke run under Triton's interpreter, at a small shape
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.kernels.common import DEV, ceiling_d2d, fill_expert_set, time_graph  # noqa: E402
from bench.kernels.expert_up import addr_sets  # noqa: E402
from kernels.expert_block import SUPER, ExpertGeometry  # noqa: E402
from kernels.expert_layer import expert_layer  # noqa: E402
from kernels.expert_up import expert_up, expert_up_torch, relu2_group_mask_torch  # noqa: E402
from bench.kernels.moe_vram_layer import vram_layer  # noqa: E402
from kernels.expert_vram import DOWN_CONFIG, UP_CONFIG, vram_down, vram_expert_decode, vram_up  # noqa: E402
from kernels.moe_ops import expert_decode_torch  # noqa: E402
from kernels.sparse_down import sparse_down, sparse_down_torch  # noqa: E402
from kernels.testing import rel_err  # noqa: E402
from bench.kernels.vram_down_variants import vram_down_variant  # noqa: E402

K = 22
# H200 run 1 (bench/results/moe_vram_h200_session6_run1.log), µs natural / 72 % / 7 % groups active:
# up: today's mode 4 58 (255 registers + spills, 2 programs/SM: the unaligned base), expert_up mode 8 43 (same loads),
#   vram_up prepared BN64 19.3 (the winner), BN32 w2 20.6, BN128 24.5 (3/SM), BN128 w8 20.9, build BN64 20.9 (its B per
#   tile costs more than the x launch it saves), build BN128 21.6
# down: today's gpp4 73 / 58 / 16, sparse_down gpp1 51 / 37 / 10; vram_down QUAD 8 x 256 32 / 30 / 17 (wired), the
#   nibbles 1.1-1.2x slower where most groups are active (more instructions a weight); small chunks (2 x 512) win only
#   at 7 % (9.4): every lane of a chunk with one active group is decoded (issue-bound, not memory-bound)
# (label, fn(x, addrs, geom, ug) -> (act, mask))
UP_VARIANTS = [
    ("today: expert_up mode 4 BN64", lambda x, a, g, u: expert_up(x, a, g, u)),
    ("expert_up mode 8 BN64 (B by select)", lambda x, a, g, u: expert_up(x, a, g, u, config=dict(LOAD_MODE=8))),
]
for _build, _bn, _w, _st in ((False, 64, 4, 3), (False, 32, 2, 3), (False, 128, 4, 3), (False, 128, 8, 3),
                             (True, 64, 4, 3), (True, 128, 4, 3)):
    _cfg = dict(BLOCK_N=_bn, X_BUILD=_build, num_warps=_w, num_stages=_st)
    UP_VARIANTS.append((f"vram_up {'build' if _build else 'prepared'} BN{_bn} w{_w} st{_st}",
                        lambda x, a, g, u, c=_cfg: vram_up(x, a, g, u, config=c)))
# (label, fn(act, mask, addrs, geom, dg, w, acc))
DOWN_VARIANTS = [
    ("today: sparse_down gpp4 BL1024", lambda *a: sparse_down(*a)),
    ("sparse_down gpp1 BL1024", lambda *a: sparse_down(*a, config=dict(GROUPS_PER_PROG=1))),
]
for _gpp, _bl, _w, _q in ((2, 512, 4, 0), (4, 512, 4, 0), (4, 256, 4, 0), (8, 256, 4, 0), (8, 128, 4, 0),
                          (16, 128, 4, 0), (4, 256, 4, 1), (8, 256, 4, 1), (8, 128, 4, 1), (16, 128, 4, 1),
                          (16, 256, 4, 2), (8, 256, 4, 2), (16, 128, 4, 2), (4, 256, 4, 2), (1, 1024, 4, 0),
                          (2, 256, 4, 0), (2, 512, 4, 1), (4, 512, 4, 1)):
    _cfg = dict(GROUPS_PER_PROG=_gpp, BLOCK_L=_bl, num_warps=_w, QUAD=_q > 0, DOT=_q == 2)
    DOWN_VARIANTS.append((f"vram_down gpp{_gpp} BL{_bl} w{_w}{['', ' quad', ' dot'][_q]}",
                          lambda *a, c=_cfg: vram_down_variant(*a, config=c)))
for _gpp, _bl, _sub in ((16, 256, 4), (8, 256, 2), (16, 256, 2), (32, 256, 4), (16, 128, 4)):
    _cfg = dict(GROUPS_PER_PROG=_gpp, BLOCK_L=_bl, COMPACT=_sub)
    DOWN_VARIANTS.append((f"vram_down gpp{_gpp} BL{_bl} compact{_sub}", lambda *a, c=_cfg: vram_down(*a, config=c)))

# the one-launch VRAM layer (bench/kernels/moe_vram_layer.py): lost everywhere in run 1 (68 / 68 / 42.5 µs against the
# two launches' 51 / 48.5 / 35): a program's down waits for its own up, holding the up's registers
FUSED_VARIANTS = [dict(BLOCK_N=64, BLOCK_L=256, QUAD=False), dict(BLOCK_N=128, BLOCK_L=128, QUAD=False),
                  dict(BLOCK_N=64, BLOCK_L=256, QUAD=True), dict(BLOCK_N=128, BLOCK_L=128, QUAD=True)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=100.0, help="stop timing new variants after this")
    ap.add_argument("--out", default="moe_vram.json")
    a = ap.parse_args(argv)
    t0 = time.time()
    smoke = DEV == "cpu"
    geom = ExpertGeometry(64, 96) if smoke else SUPER
    n = 24 if smoke else 64
    vram = torch.empty(3 * n * geom.block_stride, dtype=torch.uint8, device=DEV)
    fill_expert_set(vram, geom, n, 0.075, False, seed=1)
    fill_expert_set(vram[n * geom.block_stride:], geom, n, 0.075, True, seed=2)
    # 3.1 % of neurons, independent: ~40 % of the groups active, as in the profile's synthetic checkpoint
    fill_expert_set(vram[2 * n * geom.block_stride:], geom, n, 0.031, False, seed=3)
    d2d = ceiling_d2d() / 1e9
    env = dict(device=torch.cuda.get_device_name(0) if not smoke else "cpu (interpreter)", d2d_GBps=d2d)
    print(f"env {env}, filled in {time.time() - t0:.1f}s", flush=True)
    ug = torch.full((K,), 2e-3, device=DEV)
    dg = torch.full((K,), 2e-3, device=DEV)
    w = torch.rand(K, device=DEV) / K
    x_pos = (torch.rand(geom.L, device=DEV) + 0.05).bfloat16()
    x_mixed = torch.randn(geom.L, device=DEV).bfloat16()
    cases = [("natural ~50% neurons", 0, x_mixed), ("92.5% zero, independent", 0, x_pos),
             ("92.5% zero by groups", n, x_pos), ("96.9% zero, independent", 2 * n, x_pos)]
    # the budget bounds compilation: once over it, no variant is tried that an earlier case has not compiled (the
    # later cases re-time the compiled ones: milliseconds each)
    rows, checks, tried = [], [], set()

    def skip(kind, label):
        if (kind, label) in tried:
            return False
        if time.time() - t0 > a.budget_s:
            return True
        tried.add((kind, label))
        return False

    def row(part, case, label, sec, nb):
        r = dict(part=part, case=case, variant=label, us=sec * 1e6, bytes=nb, pct_hbm=100 * nb / sec / (d2d * 1e9),
                 floor_us=nb / (d2d * 1e9) * 1e6)
        rows.append(r)
        print(f"  {part:5s} | {case:24s} | {label:40s} | {r['us']:7.1f} us | {r['pct_hbm']:5.1f}% of HBM | "
              f"floor {r['floor_us']:.1f} us", flush=True)
        return r

    def check(what, out, ref, tol=1e-5):
        e = rel_err(out, ref)
        checks.append(dict(check=what, rel_err=e, ok=e < tol))
        return e < tol

    for case, first, x in cases:
        sets = addr_sets(vram.data_ptr(), geom, first, n, K)
        blocks0 = [vram[(first + j % n) * geom.block_stride:][: geom.block_stride] for j in range(K)]
        ref_act, ref_mask = relu2_group_mask_torch(expert_up_torch(x, blocks0, geom, ug))
        ref_acc = expert_decode_torch(x, blocks0, geom, ug, dg, w)
        ams = [expert_up(x, s, geom, ug) for s in sets]           # the up's real act / mask per set
        nb_up = K * geom.up_bytes
        nb_down = sum(int(m.sum()) for _, m in ams) / len(ams) * geom.group_bytes
        print(f"{case}: groups active {nb_down / geom.group_bytes / (K * geom.n_groups):.1%}", flush=True)
        best_up, best_down = None, None
        for label, fn in UP_VARIANTS:
            if skip("up", label):
                continue
            try:
                act, mask = fn(x, sets[0], geom, ug)
                ok = check(f"up {case} {label}", act, ref_act) and torch.equal(mask.cpu(), ref_mask.cpu())
                if not ok:
                    print(f"  BAD up {label}", flush=True)
                    continue
                r = row("up", case, label, time_graph(lambda i, fn=fn: fn(x, sets[i % 8], geom, ug), 8), nb_up)
            except Exception as e:  # noqa: BLE001 - one variant that does not compile must not end the sweep
                print(f"  FAILED up {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if best_up is None or r["us"] < best_up[2]:
                best_up = (label, fn, r["us"])
        acc = torch.zeros(geom.L, device=DEV)
        for label, fn in DOWN_VARIANTS:
            if skip("down", label):
                continue
            try:
                out = fn(ams[0][0], ams[0][1], sets[0], geom, dg, w, torch.zeros(geom.L, device=DEV))
                ref = sparse_down_torch(ams[0][0], ams[0][1], blocks0, geom, dg, w, torch.zeros(geom.L, device=DEV))
                if not check(f"down {case} {label}", out, ref):
                    print(f"  BAD down {label}", flush=True)
                    continue
                r = row("down", case, label,
                        time_graph(lambda i, fn=fn: fn(*ams[i % 8], sets[i % 8], geom, dg, w, acc), 8), nb_down)
            except Exception as e:  # noqa: BLE001
                print(f"  FAILED down {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if best_down is None or r["us"] < best_down[2]:
                best_down = (label, fn, r["us"])
        pairs = [("today: expert_up + sparse_down (pinned defaults)",
                  lambda s, acc: sparse_down(*expert_up(x, s, geom, ug), s, geom, dg, w, acc)),
                 ("expert_up + sparse_down gpp1",
                  lambda s, acc: sparse_down(*expert_up(x, s, geom, ug), s, geom, dg, w, acc,
                                             config=dict(GROUPS_PER_PROG=1))),
                 ("fused expert_layer (pinned default)", lambda s, acc: expert_layer(x, s, geom, ug, dg, w, acc))]
        pairs += [(f"fused vram_layer {c}", lambda s, acc, c=c: vram_layer(x, s, geom, ug, dg, w, acc, config=c))
                  for c in FUSED_VARIANTS]
        pairs.append((f"wired: vram_expert_decode (two; {UP_CONFIG} {DOWN_CONFIG})",
                      lambda s, acc: vram_expert_decode(x, s, geom, ug, dg, w, acc)))
        if best_up and best_down:
            bu, bd = best_up[1], best_down[1]
            pairs.append((f"best: {best_up[0]} + {best_down[0]}",
                          lambda s, acc: bd(*bu(x, s, geom, ug), s, geom, dg, w, acc)))
        for label, fn in pairs:
            if not label.startswith(("today", "wired", "best")) and skip("layer", label):
                continue
            try:
                if not check(f"layer {case} {label}", fn(sets[0], torch.zeros(geom.L, device=DEV)), ref_acc):
                    print(f"  BAD layer {label}", flush=True)
                    continue
                row("layer", case, label, time_graph(lambda i, fn=fn: fn(sets[i % 8], acc), 8), nb_up + nb_down)
            except Exception as e:  # noqa: BLE001
                print(f"  FAILED layer {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        _dump(a.out, env, rows, checks)
    bad = [c for c in checks if not c["ok"]]
    print(f"checks: {len(checks) - len(bad)} ok, {len(bad)} BAD {[c['check'] for c in bad]}")
    for part in ("up", "down", "layer"):
        for case, _, _ in cases:
            rs = sorted((r for r in rows if r["part"] == part and r["case"] == case), key=lambda r: r["us"])
            if rs:
                print(f"best {part} {case}: {rs[0]['variant']} {rs[0]['us']:.1f} us ({rs[0]['pct_hbm']:.0f}% of HBM)"
                      f"; today {next((r['us'] for r in rs if r['variant'].startswith('today')), float('nan')):.1f}")
    print(f"total {time.time() - t0:.0f}s")
    _dump(a.out, env, rows, checks)


def _dump(out, env, rows, checks):
    d = os.path.dirname(out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(env=env, rows=rows, checks=checks), f, indent=1)


if __name__ == "__main__":
    main()
