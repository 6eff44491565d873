"""The decode GEMVs' fixed cost per call (issue 19, part 1; session 7, h27, run 2): programmatic dependent launch.

    python -m bench.kernels.gemv_pdl_sweep [--out pdl.json] [--budget-s 100] [--only SHAPE,..] [--passes ..]

Run 1 (bench.kernels.gemv_streamk_sweep, bench/NOTES.md) found no per-tile limit to remove at M = 1: balanced shares
and the scales loaded ahead lost or tied everywhere, and every shape fits `fixed + bytes / ~3.3 TB/s` with a fixed
~5-8 µs per call (fc2's 2.4 MB take 5.4 µs, the lm_head's 302 MB ~95). PDL (config key PDL: launched with
launch_pdl, gdc_wait before any memory the previous kernel may touch, then gdc_launch_dependents) lets a GEMV's
programs start while the previous kernel drains; PREFETCH also asks L2 for each program's first weight tile before
the wait. Per shape and M: today's configuration and run 1's best STREAM_K one (RUN1_BEST), each plain / PDL /
PDL + PREFETCH, timed two ways:
  chain     the GEMV after itself, as the other sweeps time (what a run of GEMVs in a decode graph gets);
  producer  after a non-PDL kernel that writes x (a copy), minus that kernel alone: the engine's case, where the
            kernel before a GEMV is a norm, a conv or a scan that PDL does not overlap with its own start.
Every variant checked against the twin at full size, before and after its timing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module defines its kernels

import triton  # noqa: E402

from bench.kernels.common import DEV, ceiling_d2d, time_graph, report_checks  # noqa: E402
from bench.kernels.gemv_streamk_sweep import CUDA, Family, _copies, precompile  # noqa: E402
from kernels.testing import rel_err  # noqa: E402

TOL = 5e-3
PASSES = ("nvfp4:1", "nvfp4:8", "fp8:1+8", "nvfp4:2", "nvfp4:4")
# run 1's fastest STREAM_K configuration per (family, shape, M) (bench/results/gemv_streamk_h200_session7_run1.json)
RUN1_BEST = {
    ('fp8', 'fc1_latent', 1): ('sk1 build', {'STREAM_K': 1, 'X_BUILD': True}),
    ('fp8', 'fc1_latent', 8): ('sk1 build', {'STREAM_K': 1, 'X_BUILD': True}),
    ('fp8', 'mamba.in_proj', 1): ('sk4 st3', {'STREAM_K': 4, 'num_stages': 3}),
    ('fp8', 'mamba.in_proj', 8): ('sk3 build', {'STREAM_K': 3, 'X_BUILD': True}),
    ('fp8', 'mamba.out_proj', 1): ('sk2', {'STREAM_K': 2}),
    ('fp8', 'mamba.out_proj', 8): ('sk2 build', {'STREAM_K': 2, 'X_BUILD': True}),
    ('fp8', 'shared.down', 1): ('sk3', {'STREAM_K': 3}),
    ('fp8', 'shared.down', 8): ('sk3 build', {'STREAM_K': 3, 'X_BUILD': True}),
    ('fp8', 'shared.up', 1): ('sk3', {'STREAM_K': 3}),
    ('fp8', 'shared.up', 8): ('sk3 build', {'STREAM_K': 3, 'X_BUILD': True}),
    ('nvfp4', 'attn.k/v', 1): ('sk8 BN32 w2 build',
        {'BLOCK_N': 32, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 2, 'STREAM_K': 8}),
    ('nvfp4', 'attn.k/v', 2): ('sk4 BN64 build',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'attn.k/v', 4): ('sk4 BN64 build',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'attn.k/v', 8): ('sk4 BN64 build',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'attn.q/o', 1): ('sk5 build r96',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 5, 'maxnreg': 96}),
    ('nvfp4', 'attn.q/o', 2): ('sk6 build',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 6}),
    ('nvfp4', 'attn.q/o', 4): ('sk2 build',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'attn.q/o', 8): ('sk2 inline',
        {'BLOCK_N': 128, 'X_INLINE': True, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'fc1_latent', 1): ('sk3 build sa1',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 3, 'SCALE_AHEAD': 1}),
    ('nvfp4', 'fc1_latent', 2): ('sk4 mode9 build',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4, 'LOAD_MODE': 9, 'BLOCK_K': 256}),
    ('nvfp4', 'fc1_latent', 4): ('sk2 build',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'fc1_latent', 8): ('sk2 inline',
        {'BLOCK_N': 128, 'X_INLINE': True, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'fc2_latent', 1): ('sk3 build sa1',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 3, 'SCALE_AHEAD': 1}),
    ('nvfp4', 'fc2_latent', 2): ('sk3 build',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 3}),
    ('nvfp4', 'fc2_latent', 4): ('sk4 BN64 build',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'fc2_latent', 8): ('sk2 inline',
        {'BLOCK_N': 128, 'X_INLINE': True, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'lm_head', 1): ('sk3 BN128',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 3}),
    ('nvfp4', 'lm_head', 2): ('sk4 mode9',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4, 'LOAD_MODE': 9, 'BLOCK_K': 256}),
    ('nvfp4', 'lm_head', 4): ('sk8',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 8}),
    ('nvfp4', 'lm_head', 8): ('sk8',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 8}),
    ('nvfp4', 'mamba.in_proj', 1): ('sk2 BN128',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'mamba.in_proj', 2): ('sk4',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'mamba.in_proj', 4): ('sk4 BN64',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'mamba.in_proj', 8): ('sk3',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 3}),
    ('nvfp4', 'mamba.out_proj', 1): ('sk2 BN128',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'mamba.out_proj', 2): ('sk4',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'mamba.out_proj', 4): ('sk2 BN64',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'mamba.out_proj', 8): ('sk2 BN64',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'shared.down', 1): ('sk4 build',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'shared.down', 2): ('sk4 build',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'shared.down', 4): ('sk4 BN64',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'shared.down', 8): ('sk4 BN64',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 4}),
    ('nvfp4', 'shared.up', 1): ('sk3 build',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 3}),
    ('nvfp4', 'shared.up', 2): ('sk3 build',
        {'BLOCK_N': 128, 'X_INLINE': False, 'X_BUILD': True, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 3}),
    ('nvfp4', 'shared.up', 4): ('sk2 BN64',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
    ('nvfp4', 'shared.up', 8): ('sk2 BN64',
        {'BLOCK_N': 64, 'X_INLINE': False, 'X_BUILD': False, 'SPLIT_REDUCE': 0, 'ONE_DOT': False,
         'num_stages': 3, 'num_warps': 4, 'STREAM_K': 2}),
}


def variants(fam: str, name: str, M: int) -> dict[str, dict]:
    v: dict[str, dict] = {"today": {}, "today pdl": dict(PDL=True), "today pdl pf": dict(PDL=True, PREFETCH=True)}
    best = RUN1_BEST.get((fam, name, M))
    if best:
        label, cfg = best
        v[label] = dict(cfg)
        v[f"{label} pdl"] = dict(cfg, PDL=True)
        v[f"{label} pdl pf"] = dict(cfg, PDL=True, PREFETCH=True)
    return v


class PdlFamily(Family):
    def variants(self, M, N, K):
        return variants(self.name, self._shape, M)


def run_pass(fam_name, ms, budget_s, hbm, rows, checks, t0, only, dump) -> bool:
    fam = PdlFamily(fam_name)
    for name, N, K, per_token in fam.shapes():
        if only and name not in only:
            continue
        fam._shape = name
        copies = _copies(fam.bytes(N, K, 1))
        ws = fam.weights(N, K, copies, seed=N + K)
        for M in ms:
            x = torch.randn(M, K, device=DEV).bfloat16()
            x_src = x.clone()
            ref = fam.twin(x, ws[0])
            t_prod = time_graph(lambda i: x.copy_(x_src), 2 * copies)
            for label, cfg in variants(fam_name, name, M).items():
                if time.time() - t0 > budget_s:
                    print(f"  budget of {budget_s:.0f} s spent: {fam_name} {name} M={M} {label} and after not timed",
                          flush=True)
                    return False
                fn = fam.fn(cfg, x)
                try:
                    e = rel_err(fn(*ws[0]), ref)
                except Exception as ex:  # noqa: BLE001 - one failing variant must not hide the others
                    print(f"  {fam_name} {name} M={M} {label} FAILED: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    checks.append(dict(check=f"{fam_name} {name} M={M} {label}", rel_err=float("inf"), ok=False,
                                       error=f"{type(ex).__name__}: {str(ex)[:300]}"))
                    continue
                checks.append(dict(check=f"{fam_name} {name} M={M} {label}", rel_err=e, ok=e < TOL))
                if not e < TOL:
                    print(f"  {fam_name} {name} M={M} {label} WRONG: rel err {e:.2e}", flush=True)
                    continue
                try:
                    chain = time_graph(lambda i: fn(*ws[i % copies]), 2 * copies)
                    both = time_graph(lambda i: (x.copy_(x_src), fn(*ws[i % copies])), 2 * copies)
                except Exception as ex:  # noqa: BLE001
                    print(f"  {fam_name} {name} M={M} {label} timing FAILED: {type(ex).__name__}: {str(ex)[:200]}",
                          flush=True)
                    continue
                e_after = rel_err(fn(*ws[0]), ref)
                if not e_after < TOL:
                    checks.append(dict(check=f"{fam_name} {name} M={M} {label} after timing", rel_err=e_after,
                                       ok=False))
                    print(f"  {fam_name} {name} M={M} {label} WRONG after timing: rel err {e_after:.2e}", flush=True)
                    continue
                nb = fam.bytes(N, K, M)
                prod = both - t_prod
                row = dict(family=fam_name, shape=name, N=N, K=K, M=M, variant=label, us=chain * 1e6,
                           pct=100 * nb / chain / hbm, us_after_producer=prod * 1e6,
                           pct_after_producer=100 * nb / prod / hbm, producer_us=t_prod * 1e6, bytes=nb,
                           rel_err=max(e, e_after), per_token=per_token, config=cfg)
                rows.append(row)
                print(f"  {fam_name:5s} {name:15s} M={M} {label:26s} chain {row['us']:6.1f} us {row['pct']:4.0f}%   "
                      f"after producer {row['us_after_producer']:6.1f} us {row['pct_after_producer']:4.0f}%",
                      flush=True)
        del ws
        dump()
    return True


def summary(rows):
    for fam in dict.fromkeys(r["family"] for r in rows):
        print(f"\n== {fam}: today vs best, chain / after a producer (us, % of D2D) ==")
        keys = dict.fromkeys((r["shape"], r["M"]) for r in rows if r["family"] == fam)
        sums = {"today": [0.0, 0.0], "best": [0.0, 0.0]}
        for shape, M in sorted(keys, key=lambda k: (k[1], k[0])):
            rs = [r for r in rows if r["family"] == fam and r["shape"] == shape and r["M"] == M]
            today = next((r for r in rs if r["variant"] == "today"), None)
            bc = min(rs, key=lambda r: r["us"])
            bp = min(rs, key=lambda r: r["us_after_producer"])
            t = (f"{today['us']:6.1f} {today['pct']:3.0f}% / {today['us_after_producer']:6.1f} "
                 f"{today['pct_after_producer']:3.0f}%") if today else "-"
            print(f"  {shape:15s} {M}  today {t}   best chain {bc['us']:6.1f} {bc['pct']:3.0f}% ({bc['variant']})   "
                  f"best after producer {bp['us_after_producer']:6.1f} {bp['pct_after_producer']:3.0f}% "
                  f"({bp['variant']})")
            if M == 1 and today:
                sums["today"][0] += today["us"] * today["per_token"]
                sums["today"][1] += today["us_after_producer"] * today["per_token"]
                sums["best"][0] += bc["us"] * bc["per_token"]
                sums["best"][1] += bp["us_after_producer"] * bp["per_token"]
        print(f"  M = 1 per token (chain / after producer): today {sums['today'][0] / 1e3:.2f} / "
              f"{sums['today'][1] / 1e3:.2f} ms, best {sums['best'][0] / 1e3:.2f} / {sums['best'][1] / 1e3:.2f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemv_pdl.json"))
    ap.add_argument("--budget-s", type=float, default=100.0)
    ap.add_argument("--only", default="", help="comma-separated shape names")
    ap.add_argument("--precompile", type=int, default=12 if CUDA else 0)
    ap.add_argument("--passes", default=",".join(PASSES))
    a = ap.parse_args(argv)
    t0 = time.time()
    env = dict(gpu=torch.cuda.get_device_name(0) if CUDA else "none (CPU smoke run, TRITON_INTERPRET=1)",
               torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print("env", env, flush=True)
    d2d = ceiling_d2d()
    print(f"D2D {d2d / 1e9:.0f} GB/s", flush=True)
    rows, checks = [], []
    only = set(s for s in a.only.split(",") if s)
    passes = [(p.split(":")[0], [int(m) for m in p.split(":")[1].split("+")]) for p in a.passes.split(",")]

    def dump(done=False):
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(env=env, d2d_GBps=d2d / 1e9, rows=rows, checks=checks, complete=done), f, indent=1,
                      default=str)

    if a.precompile > 0:
        precompile(passes, only, a.precompile, variants_of=lambda fam, name, M, N, K: variants(fam, name, M))
    done = True
    for fam, ms in passes:
        print(f"-- pass {fam} M={ms} at {time.time() - t0:.0f} s", flush=True)
        if not run_pass(fam, ms, a.budget_s, d2d, rows, checks, t0, only, dump):
            done = False
            break
    summary(rows)
    bad = report_checks(checks)
    dump(done)
    print(f"wrote {a.out}; total {time.time() - t0:.0f} s")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
