"""The dense prefill path's A/B in one process: prompts prefilled with the layers' NVFP4/FP8 projections decoded once
per span (kernels.dense_prefill, on: the plan's default), with a bound below the largest layer's where the budget
gives one (partial: gpu_worker.prefill.PARTIAL_DEQUANT, off by default), and with the tile-decoding kernels (off),
alternating, on the streaming engine
with every expert in RAM (bench.profile_kernels' setting), so that machine drift between two runs cannot pass for a
difference. Also each mode's device peak beside the span model's estimate.

    python -m bench.dense_prefill_ab --work DIR [--moe-layers 4] [--sizes 1000,4000,16000] [--reps 3]
        [--budgets-mib 0,512] [--out F.json]

Budgets: 0 is the default (half the free device memory), 512 the server's reserve (`--vram-gb`): there the largest
layer's decoded weights do not fit, so the plan decodes nothing and `partial` gives them what the heaviest layer
leaves (gpu_worker/prefill.py `dequant_bound`; in_proj then keeps the tile kernel).

DIR/model and DIR/store as bench.profile_kernels makes them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--sizes", default="1000,4000,16000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budgets-mib", default="0,512")
    ap.add_argument("--out", default="dense_prefill_ab.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.dense_prefill_ab times the engine's prefill on CUDA: no device here")
    from bench.workdir import all_experts_bytes, super_store, warm_all
    from gpu_worker.engine import StreamingEngine
    from gpu_worker.prefill import default_budget, dequant_terms, prefill, span_bytes, span_plan
    import gpu_worker.prefill as span_model
    from kernels import dense_prefill
    _, store_dir, store = super_store(a.work, a.moe_layers)
    cache = all_experts_bytes(store)
    g = torch.Generator().manual_seed(5)
    res = dict(device=torch.cuda.get_device_name(), sizes={})
    with StreamingEngine(store_dir, cache_bytes=cache, io_workers=8, device="cuda", dtype=torch.bfloat16) as eng:
        warm_all(eng, store)
        m = eng.model
        for k, mib in [(int(s), int(b)) for b in a.budgets_mib.split(",") for s in a.sizes.split(",") if s]:
            ids = torch.randint(14, 1000, (k,), generator=g).tolist()
            budget = (mib << 20) or default_budget(m.device)
            plan = span_plan(m.config, m.dtype, budget, m.device)
            modes = {"on": (True, False), "off": (False, False)}
            if plan.pieces.dequant_bytes < max(dequant_terms(m.config, 2).values()):
                modes["partial"] = (True, True)
            walls, peaks = {mode: [] for mode in modes}, {}
            for on, partial in modes.values():            # warm each (compiles, cuBLAS heuristics)
                dense_prefill.ENABLED, span_model.PARTIAL_DEQUANT = on, partial
                prefill(m, ids, m.new_state(), budget_bytes=budget)
            for _ in range(a.reps):
                for mode, (on, partial) in modes.items():
                    dense_prefill.ENABLED, span_model.PARTIAL_DEQUANT = on, partial
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    t = time.perf_counter()
                    prefill(m, ids, m.new_state(), budget_bytes=budget)
                    torch.cuda.synchronize()
                    walls[mode].append((time.perf_counter() - t) * 1e3)
                    peaks[mode] = max(peaks.get(mode, 0), torch.cuda.max_memory_allocated() - base)
            dense_prefill.ENABLED, span_model.PARTIAL_DEQUANT = True, False
            est = span_bytes(m.config, m.dtype, k, plan=plan)
            row = dict(ms=walls, median={k_: statistics.median(v) for k_, v in walls.items()}, peak=peaks,
                       estimate=est, dequant_bytes=plan.pieces.dequant_bytes, budget=budget)
            res["sizes"][f"{k}@{mib}"] = row
            print(f"{k} tokens, budget {budget / 2**20:.0f} MiB (plan's dequant bound "
                  f"{plan.pieces.dequant_bytes / 2**20:.0f} MiB, span estimate {est / 2**20:.0f} MiB): " + "; ".join(
                      f"{mode} {row['median'][mode]:.1f} ms {['%.1f' % w for w in walls[mode]]} peak "
                      f"{peaks[mode] / 2**20:.0f} MiB" for mode in modes), flush=True)
            text = json.dumps(res, indent=1)        # after every row: a run stopped by its time limit keeps them
            Path(a.out).write_text(text)
            if os.environ.get("OUT"):
                Path(os.environ["OUT"], Path(a.out).name).write_text(text)


if __name__ == "__main__":
    main()
