"""Which device kernels a decode token or a prompt's prefill spends its time in (torch.profiler, CUPTI).

    python -m bench.profile_kernels --work DIR [--moe-layers 4] [--decode ram,vram] [--prefill 1000,16000]

Reuses DIR/model and DIR/store from bench.e2e_stream / bench.prefill (writes them if missing). Every expert is
cached (the RAM regime); `vram` adds a VRAM tier that holds every expert (the layers routed on the device, as
bench.e2e_stream's `vram` regime). Kernels inside CUDA-graph replays are reported one by one by CUPTI.

For each case it prints the wall time, the summed kernel time (GPU busy) and the top kernels by device time, per
token (decode) or per prompt (prefill), each with its calls, and a coarse split by kernel family (the names the
engine's kernels carry), so that "where the time goes" is read from the device, not guessed from the code.
The profiler costs some host time: the wall time without it is printed beside.
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import time
from pathlib import Path

import torch

# kernel-name patterns -> family (first match wins); what is left is "other"
FAMILIES = (
    ("expert_up", r"_expert_up|expert_layer|_fused_expert|_vram_up"),
    ("sparse_down", r"_sparse_down|_vram_down"),
    ("router", r"_router_"),
    ("expert_prefill", r"expert_prefill|_grouped|dequant|_rega_"),
    ("gemv_nvfp4", r"_nvfp4_gemv|_x_operands|_split_reduce"),
    ("gemv_fp8", r"fp8_gemv|_fp8"),
    ("mamba", r"mamba|_scan|_conv|ssd|selective|_carry"),
    ("attention", r"attention|flash|fmha|sdpa|_attn"),
    ("gemm (cuBLAS)", r"nvjet|gemm|sm90_xmma|cutlass|cublas"),
    ("copies", r"[Mm]emcpy|[Mm]emset|copy_kernel|CatArrayBatched"),
    ("sort/topk/index", r"sort|topk|TopK|index|scatter|gather|radix|cub::"),
    ("elementwise/reduce", r"elementwise|reduce_kernel|vectorized|unrolled"),
)


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name):
            return fam
    return "other"


def kernel_table(prof, per: float) -> dict:
    """{kernel name: (device µs per unit, calls per unit)} from a profile, and the family sums."""
    rows = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us <= 0:
            continue
        rows[e.key] = (us / per, e.count / per)
    fams: dict = {}
    for k, (us, n) in rows.items():
        f = fams.setdefault(family(k), [0.0, 0.0])
        f[0] += us
        f[1] += n
    return dict(kernels=dict(sorted(rows.items(), key=lambda kv: -kv[1][0])),
                families=dict(sorted(((k, tuple(v)) for k, v in fams.items()), key=lambda kv: -kv[1][0])),
                busy_us=sum(us for us, _ in rows.values()), launches=sum(n for _, n in rows.values()))


def show(title: str, wall_ms: float, wall_noprof_ms: float, t: dict, top: int, unit: str) -> None:
    print(f"\n== {title}: wall {wall_noprof_ms:.3f} ms/{unit} (profiled {wall_ms:.3f}), kernels busy "
          f"{t['busy_us'] / 1e3:.3f} ms/{unit}, {t['launches']:.0f} kernels/{unit}")
    print("family | ms | kernels | share of busy")
    for k, (us, n) in t["families"].items():
        print(f"{k} | {us / 1e3:.3f} | {n:.0f} | {us / max(t['busy_us'], 1e-9):.1%}")
    print(f"top kernels | µs/{unit} | calls/{unit} | µs/call")
    for k, (us, n) in list(t["kernels"].items())[:top]:
        print(f"{k[:90]} | {us:.1f} | {n:.1f} | {us / max(n, 1e-9):.2f}")


def profiled(fn, reps: int):
    """(profile, wall ms per rep profiled, wall ms per rep without the profiler)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t) * 1e3 / reps
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3 / reps
    return prof, wall, plain


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--decode", default="ram,vram", help="comma list of ram,vram ('' for none)")
    ap.add_argument("--prefill", default="1000,16000", help="prompt sizes, RAM regime ('' for none)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--vram-gb", type=float, default=12.0)
    ap.add_argument("--tier-mb", type=float, default=0,
                    help="prefill: a VRAM tier of this size beside the engine, filled with random experts as "
                         "bench.prefill's --tier-mb (the prompt reads its residents in place)")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", default="profile_kernels.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.profile_kernels profiles device kernels: no CUDA device here")
    from bench.workdir import all_experts_bytes, super_store, warm_all
    from gpu_worker.engine import StreamingEngine
    from gpu_worker.prefill import prefill
    _, store_dir, store = super_store(a.work, a.moe_layers)
    cache = all_experts_bytes(store)
    res: dict = dict(moe_layers=len(store.moe_layers), device=torch.cuda.get_device_name())
    out = Path(a.out)
    g = torch.Generator().manual_seed(5)
    vocab = 1000

    def ids(k):
        return torch.randint(14, vocab, (k,), generator=g).tolist()

    for regime in [r for r in a.decode.split(",") if r]:
        gc.collect()
        torch.cuda.empty_cache()
        kw = {}
        if regime == "vram":
            kw = dict(vram_bytes=int(a.vram_gb * 2**30) + torch.cuda.memory_allocated(), vram_admit_after=1)
        with StreamingEngine(store_dir, cache_bytes=cache, io_workers=8, device="cuda", dtype=torch.bfloat16,
                             **kw) as eng:
            warm_all(eng, store)
            m = eng.model
            st = m.new_state()
            tok = [int(m.forward(ids(64), st, last_only=True)[-1].argmax())]
            steps = 4 * a.tokens if regime == "vram" else 8       # the tier fills whole layers, 64 blocks a token
            for _ in range(steps):
                tok[0] = int(eng.step(tok[0], st)[-1].argmax())

            def one():
                tok[0] = int(eng.step(tok[0], st)[-1].argmax())

            prof, wall, plain = profiled(one, a.tokens)
            t = kernel_table(prof, a.tokens)
            vt = eng.experts.vram
            if vt is not None:
                t["tier_complete_layers"] = [j for j in range(len(store.moe_layers)) if vt.complete(j)]
            t.update(wall_ms=wall, wall_ms_noprof=plain)
            res[f"decode_{regime}"] = t
            show(f"decode, {regime}", wall, plain, t, a.top, "token")
        out.write_text(json.dumps(res, indent=1))

    sizes = [int(s) for s in a.prefill.split(",") if s]
    if sizes:
        gc.collect()
        torch.cuda.empty_cache()
        with StreamingEngine(store_dir, cache_bytes=cache, io_workers=8, device="cuda", dtype=torch.bfloat16) as eng:
            warm_all(eng, store)
            if a.tier_mb:
                from bench.prefill import fill_tier
                fill_tier(eng, int(a.tier_mb * 2**20), "cuda", store)
                res["prefill_tier_mb"] = a.tier_mb
            for k in sizes:
                p = ids(k)
                prefill(eng.model, p, eng.model.new_state())        # compiles this size's configurations
                prof, wall, plain = profiled(lambda: prefill(eng.model, p, eng.model.new_state()), 2)
                t = kernel_table(prof, 2)
                last = eng.experts.prefill_acct.last
                t.update(wall_ms=wall, wall_ms_noprof=plain, launches_by_source=last.launches,
                         tier_read=last.tier_read, launches_rega=last.launches_rega)
                res[f"prefill_{k}"] = t
                tier = f", tier {a.tier_mb:g} MiB" if a.tier_mb else ""
                show(f"prefill, {k} tokens (RAM, staged{tier})", wall, plain, t, a.top, "prompt")
                out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
