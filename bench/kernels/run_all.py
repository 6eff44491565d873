"""The whole kernel benchmark in one GPU call: ceilings first, then each op at Nemotron 3 Super shapes.

    python -m bench.kernels.run_all [--only zero,gemv,lost,up,down,layer,prefill,mamba,attn] [--out DIR]

Prints a short table last and writes results.json (ceilings, rows, correctness checks) into --out or $OUT.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():  # a smoke run of the whole script on the CPU, Triton interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from bench.kernels import common  # noqa: E402
from kernels.expert_block import SUPER, ExpertGeometry  # noqa: E402

SECTIONS = [("zero", "bench.kernels.zero_copy"), ("gemv", "bench.kernels.gemv_nvfp4"),
            ("lost", "bench.kernels.gemv_nvfp4_modes"),
            ("up", "bench.kernels.expert_up"), ("down", "bench.kernels.sparse_down"),
            ("layer", "bench.kernels.moe_layer"), ("prefill", "bench.kernels.expert_prefill"),
            ("mamba", "bench.kernels.mamba_step"), ("attn", "bench.kernels.attention_decode")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    t0 = time.time()
    smoke = common.DEV == "cpu"
    if smoke:
        env = dict(gpu="none (CPU smoke run, TRITON_INTERPRET=1)", sms=0)
    else:
        dev = torch.cuda.get_device_properties(0)
        env = dict(gpu=dev.name, sms=dev.multi_processor_count)
    env.update(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print("env", env, flush=True)
    geom = ExpertGeometry(64, 96) if smoke else SUPER
    n_per_set = 24 if smoke else 64
    ctx = dict(geom=geom, n_per_set=n_per_set, checks=[], ceil={})
    if smoke:
        ctx.update(gemv_shapes=[("mamba.in_proj", 48, 512), ("mamba.out_proj", 32, 256)],
                   gemv_sweep=[(32, 1, 4, 3, 3), (16, 1, 4, 3, 4)], big=(40, 256), prefill_rows=20,
                   mamba_shape=(4, 16, 32, 2, 64), attn_shape=(32, 2, 16), attn_lengths=(40,),
                   prefill_tokens=(20,))
    slab = common.HostSlab(2 * n_per_set * geom.block_stride)
    ctx["slab"] = slab
    print(f"slab {slab.nbytes / 2**20:.0f} MiB registered={slab.registered}", flush=True)
    common.fill_expert_set(slab.tensor, geom, n_per_set, 0.075, False, seed=1)
    common.fill_expert_set(slab.tensor[n_per_set * geom.block_stride:], geom, n_per_set, 0.075, True, seed=2)
    ctx["vram"] = slab.tensor.to(common.DEV, copy=True)
    print(f"filled in {time.time() - t0:.1f}s", flush=True)

    c = ctx["ceil"]
    c["d2d_GBps"] = common.ceiling_d2d() / 1e9
    pinned = torch.empty(512 << 20 if not smoke else 1 << 20, dtype=torch.uint8, pin_memory=not smoke)
    c["h2d_pinned_GBps"] = common.ceiling_h2d(pinned) / 1e9
    del pinned
    c["h2d_registered_slab_GBps"] = common.ceiling_h2d(slab.tensor) / 1e9
    print("ceilings", {k: round(v, 1) for k, v in c.items()}, flush=True)

    rows = []
    order = [k for k in (a.only.split(",") if a.only else [])] or [k for k, _ in SECTIONS]
    for key, mod in sorted(SECTIONS, key=lambda km: order.index(km[0]) if km[0] in order else len(order)):
        if only and key not in only:
            continue
        t1 = time.time()
        try:
            m = importlib.import_module(mod)
            r = m.run(ctx)
            rows.extend(r)
            for row in r:
                print("  ", _fmt(row), flush=True)
        except ModuleNotFoundError as e:
            print(f"[{key}] skipped: {e}", flush=True)
        except Exception:  # noqa: BLE001 - one broken section must not hide the others
            print(f"[{key}] FAILED\n{traceback.format_exc()}", flush=True)
            rows.append(dict(op=key, case="FAILED"))
        print(f"[{key}] {time.time() - t1:.1f}s", flush=True)
        _dump(a.out, env, c, rows, ctx["checks"])       # after every section: a run cut short keeps what it measured

    _dump(a.out, env, c, rows, ctx["checks"])
    print("\n== correctness at real sizes (GPU) ==")
    bad = [ch for ch in ctx["checks"] if not ch["ok"]]
    worst = max((ch["rel_err"] for ch in ctx["checks"] if ch["ok"]), default=0.0)
    print(f"  {len(ctx['checks']) - len(bad)} ok (worst rel err {worst:.2e}), {len(bad)} BAD")
    for ch in bad:
        print(f"  BAD {ch['check']}: rel err {ch['rel_err']:.2e}")
    print(f"\n== ceilings == D2D {c['d2d_GBps']:.0f} GB/s | H2D pinned {c['h2d_pinned_GBps']:.1f} GB/s | "
          f"H2D registered slab {c['h2d_registered_slab_GBps']:.1f} GB/s")
    print("== table ==")
    for row in rows:
        if "sweep" in row.get("op", "") or "variant" in row:   # every variant is in results.json
            continue
        print(" ", _fmt(row))
    print(f"total {time.time() - t0:.0f}s")
    slab.close()


def _dump(out, env, ceilings, rows, checks):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(env=env, ceilings=ceilings, rows=rows, checks=checks), f, indent=1, default=str)


def _fmt(r):
    parts = [f"{r.get('op', '')}: {r.get('case', '')}"]
    if "us" in r:
        parts.append(f"{r['us']:.1f} us")
    if "GBps" in r:
        parts.append(f"{r['GBps']:.0f} GB/s")
    if "pct" in r:
        parts.append(f"{r['pct']:.0f}% of {r.get('vs', 'HBM')}")
    if r.get("time_vs_all"):
        parts.append(f"t/t_all {r['time_vs_all']:.2f}")
    if "floor_us" in r:
        parts.append(f"floor {r['floor_us']:.0f} us")
    if "TFLOPs" in r:
        parts.append(f"{r['TFLOPs']:.0f} TFLOP/s")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
