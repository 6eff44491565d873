"""The decode GEMVs at HBM speed (issue 19, part 1; session 7, h27): today's NVFP4 and FP8 GEMVs (gemv_config with
GEMV_CHOICES, fp8_gemv_config) beside STREAM_K — one launch, every program the same share of the flat
(row block, K-tile) order, row blocks cut between programs joined by the last to arrive — over programs per SM,
the x operands prepared or built in the kernel, pipeline depth, register caps and row blocks; the bf16 cuBLAS
linear of the same shapes as the third column; the D2D ceiling in the same run.

    python -m bench.kernels.gemv_streamk_sweep [--out sk.json] [--budget-s 180] [--only SHAPE,..] [--passes ..]

Why STREAM_K: session 5's best in_proj (18,560 x 4,096, M = 1) runs 290 row blocks x 2 splits = 580 programs
where 4 fit on an SM (113 / 92 registers, 41 KB of shared memory): 528 run, then 52 more on 52 SMs while 80 idle;
without the split 290 programs put 3 on some SMs and 2 on most. The lm_head size's 2,048 row blocks make 3.9 waves.
Equal shares remove the tail whatever N; a share that ends inside a row block stores a partial instead of y.

Method as bench.kernels.gemv_nvfp4_sweep (whose timing and checks this reuses): each call graph-captured over weight
copies rotated through ~4x the L2, median of CUDA events; % of the D2D copy rate of this run; every variant checked
against the PyTorch twin at full size before and after timing (bf16 out, TOL 5e-3), and one must-fail twin per
family (nibbles swapped / signs flipped) on a STREAM_K configuration that cuts row blocks. The run goes in passes
(NVFP4 M = 1, 8, 2, 4, then FP8 M = 1, 8, then bf16) so that a budget cut loses the least needed; the JSON is
rewritten after every shape. Last it prints, per family, shape and M, today's µs and % beside the best variant's,
and the STREAM_K choices ready for kernels/gemv_nvfp4.py.
On a CPU it runs as a smoke test under Triton's interpreter on tiny shapes.
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

from bench.kernels.common import DEV, ceiling_d2d, time_graph  # noqa: E402
from bench.kernels.gemv_nvfp4_sweep import FP8_SHAPES, SHAPES, SMOKE_SHAPES, Fp8, Nvfp4  # noqa: E402
from kernels import gemv_nvfp4 as g  # noqa: E402
from kernels.testing import rel_err  # noqa: E402

CUDA = DEV == "cuda"
TOL = 5e-3
MARGIN = 0.97           # a variant replaces today's only if at least 3 % faster (run-to-run ~2 %)
PASSES = ("nvfp4:1", "nvfp4:8", "nvfp4:2", "nvfp4:4", "fp8:1", "fp8:8", "bf16:1,8")


def _n_sm() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 4


def nvfp4_variants(M: int, N: int, K: int) -> dict[str, dict]:
    """label -> nvfp4_linear config ({} = today's: gemv_config with GEMV_CHOICES)."""
    m_pad = triton.next_power_of_2(M)
    # experiment 4's row blocks (not GEMV_CHOICES', which may name BN32 or BN128 with their warps for the shape)
    bn = {1: 64, 2: 128, 4: 128}.get(m_pad, 64 if N >= 16384 else 128)
    v: dict[str, dict] = {"today": {}, "today sa1": dict(SCALE_AHEAD=1)}
    if g.gemv_config(M, N, K, torch.device(DEV)).get("X_BUILD"):     # today's short shapes build B from x
        v["today sa1 xa"] = dict(SCALE_AHEAD=1, X_AHEAD=True)
    plain = dict(BLOCK_N=bn, X_INLINE=False, X_BUILD=False, SPLIT_REDUCE=0, ONE_DOT=False, num_stages=3,
                 num_warps=4)
    for p in (1, 2, 3, 4, 6, 8):
        v[f"sk{p}"] = dict(plain, STREAM_K=p)
    for p in (2, 3, 4, 6):
        v[f"sk{p} build"] = dict(plain, STREAM_K=p, X_BUILD=True)
        v[f"sk{p} sa1"] = dict(plain, STREAM_K=p, SCALE_AHEAD=1)
    for p in (3, 4):
        v[f"sk{p} build sa1"] = dict(plain, STREAM_K=p, X_BUILD=True, SCALE_AHEAD=1)
    # and x's values one tile ahead too (X_AHEAD)
    v["sk4 build xa"] = dict(plain, STREAM_K=4, X_BUILD=True, X_AHEAD=True)
    v["sk3 build xa sa1"] = dict(plain, STREAM_K=3, X_BUILD=True, X_AHEAD=True, SCALE_AHEAD=1)
    # two tiles ahead: Triton 3.6 then drops the weights' cp.async pipeline (loads straight into registers)
    v["sk4 sa2"] = dict(plain, STREAM_K=4, SCALE_AHEAD=2)
    for p in (2, 4):
        v[f"sk{p} st4"] = dict(plain, STREAM_K=p, num_stages=4)
    v["sk4 st4 sa1"] = dict(plain, STREAM_K=4, num_stages=4, SCALE_AHEAD=1)
    if m_pad <= 2:   # mode 9 (scales on the decoded tile, a plain B) where mode 8 is today's
        v["sk4 mode9"] = dict(plain, STREAM_K=4, LOAD_MODE=9, BLOCK_K=256)
        v["sk4 mode9 build"] = dict(plain, STREAM_K=4, LOAD_MODE=9, BLOCK_K=256, X_BUILD=True)
        # 95-120 registers hold 4 programs of 4 warps on an SM; 96 would hold 5
        v["sk5 r96"] = dict(plain, STREAM_K=5, maxnreg=96)
        v["sk5 build r96"] = dict(plain, STREAM_K=5, X_BUILD=True, maxnreg=96)
        v["sk5 sa1 r96"] = dict(plain, STREAM_K=5, SCALE_AHEAD=1, maxnreg=96)
    if m_pad == 1:
        for p in (2, 3):
            v[f"sk{p} BN128"] = dict(plain, STREAM_K=p, BLOCK_N=128)
        v["sk3 BN128 sa1"] = dict(plain, STREAM_K=3, BLOCK_N=128, SCALE_AHEAD=1)
        for p in (4, 8):
            v[f"sk{p} BN32 w2 build"] = dict(plain, STREAM_K=p, BLOCK_N=32, num_warps=2, X_BUILD=True)
            v[f"sk{p} BN32 w2"] = dict(plain, STREAM_K=p, BLOCK_N=32, num_warps=2)
        v["sk8 BN32 w2 build sa1"] = dict(plain, STREAM_K=8, BLOCK_N=32, num_warps=2, X_BUILD=True, SCALE_AHEAD=1)
        v["sk6 BN32 w2 build xa sa1"] = dict(plain, STREAM_K=6, BLOCK_N=32, num_warps=2, X_BUILD=True, X_AHEAD=True,
                                             SCALE_AHEAD=1)
    elif m_pad == 2:
        for p in (2, 4):
            v[f"sk{p} BN64"] = dict(plain, STREAM_K=p, BLOCK_N=64)
            v[f"sk{p} BN64 build"] = dict(plain, STREAM_K=p, BLOCK_N=64, X_BUILD=True)
        v["sk4 BN64 sa1"] = dict(plain, STREAM_K=4, BLOCK_N=64, SCALE_AHEAD=1)
    else:            # mode 9: BN128 has 184-252 registers (2 programs per SM), BN64 121-128 (4)
        other = 64 if bn == 128 else 128
        for p in (2, 4):
            v[f"sk{p} BN{other}"] = dict(plain, STREAM_K=p, BLOCK_N=other)
            v[f"sk{p} BN{other} build"] = dict(plain, STREAM_K=p, BLOCK_N=other, X_BUILD=True)
        v[f"sk4 BN{other} sa1"] = dict(plain, STREAM_K=4, BLOCK_N=other, SCALE_AHEAD=1)
        if m_pad == 8:
            v["sk2 inline"] = dict(plain, STREAM_K=2, X_INLINE=True)
            v["sk2 inline sa1"] = dict(plain, STREAM_K=2, X_INLINE=True, SCALE_AHEAD=1)
    return v


def fp8_variants(M: int, N: int, K: int) -> dict[str, dict]:
    v: dict[str, dict] = {"today": {}}
    for p in (1, 2, 3, 4, 6):
        v[f"sk{p}"] = dict(STREAM_K=p)
        v[f"sk{p} build"] = dict(STREAM_K=p, X_BUILD=True)
    v["sk2 BN128"] = dict(STREAM_K=2, BLOCK_N=128)
    v["sk4 BN32 w2"] = dict(STREAM_K=4, BLOCK_N=32, num_warps=2)
    v["sk4 st3"] = dict(STREAM_K=4, num_stages=3)
    v["sk2 BK256"] = dict(STREAM_K=2, BLOCK_K=256, num_stages=3)
    return v


def nvfp4_launches(M, N, K, cfg) -> int:
    c = {**g.gemv_config(M, N, K, torch.device(DEV)), **cfg}
    n = 1 + (0 if (c.get("X_INLINE") or c.get("X_BUILD")) else 1)
    if not c.get("STREAM_K") and c["SPLIT_K"] > 1 and c.get("SPLIT_REDUCE", 0) != 1:
        n += 2
    return n


def fp8_launches(M, N, K, cfg) -> int:
    c = g.fp8_gemv_config(N, K, torch.device(DEV), cfg, M=M)
    n = 1 + (0 if c.get("X_BUILD") else 1)
    if not c.get("STREAM_K") and c["SPLIT_K"] > 1 and c.get("SPLIT_REDUCE", 0) != 1:
        n += 2
    return n


def cuts_rows(M, N, K, cfg, fp8=False) -> bool:
    """Whether a STREAM_K configuration's shares end inside row blocks (the partial path runs)."""
    if not cfg.get("STREAM_K"):
        return False
    if fp8:
        c = g.fp8_gemv_config(N, K, torch.device(DEV), cfg, M=M)
    else:
        c = {**g.gemv_config(M, N, K, torch.device(DEV)), **cfg}
        if c["LOAD_MODE"] == 8:
            c["BLOCK_K"] = 256 // c["M_PAD"]
    tiles = triton.cdiv(K, c["BLOCK_K"])
    _, per = g.stream_k_shares(triton.cdiv(N, c["BLOCK_N"]) * tiles, cfg["STREAM_K"] * _n_sm())
    return per % tiles != 0


class Family:
    def __init__(self, name):
        self.name = name
        self.op = {"nvfp4": Nvfp4.op, "fp8": Fp8.op, "bf16": "bf16 linear"}[name]

    def shapes(self):
        if not CUDA:
            return SMOKE_SHAPES
        return FP8_SHAPES if self.name == "fp8" else SHAPES

    def variants(self, M, N, K):
        if self.name == "nvfp4":
            return nvfp4_variants(M, N, K)
        if self.name == "fp8":
            return fp8_variants(M, N, K)
        return {"cuBLAS F.linear": {}}

    def bytes(self, N, K, M):
        if self.name == "bf16":
            return N * K * 2 + M * K * 2 + M * N * 2
        return (Nvfp4 if self.name == "nvfp4" else Fp8).bytes(N, K, M)

    def weights(self, N, K, copies, seed):
        if self.name == "bf16":
            gen = torch.Generator(device=DEV).manual_seed(seed)
            return [(torch.randn(N, K, device=DEV, generator=gen).bfloat16(),) for _ in range(copies)]
        return (Nvfp4 if self.name == "nvfp4" else Fp8).weights(N, K, copies, seed)

    def fn(self, cfg, x):
        c = dict(cfg) or None
        if self.name == "nvfp4":
            return lambda q, s, gs: g.nvfp4_linear(x, q, s, gs, config=c)
        if self.name == "fp8":
            return lambda w, sc: g.fp8_linear(x, w, sc, config=c)
        return lambda w: torch.nn.functional.linear(x, w)

    def twin(self, x, w):
        if self.name == "bf16":
            return x.float() @ w[0].float().t()
        return (Nvfp4 if self.name == "nvfp4" else Fp8).twin(x, w)

    def broken(self, w):
        return (Nvfp4 if self.name == "nvfp4" else Fp8).broken(w)

    def launches(self, M, N, K, cfg):
        if self.name == "bf16":
            return 1
        return (nvfp4_launches if self.name == "nvfp4" else fp8_launches)(M, N, K, cfg)


def _compile_key(fam: str, name: str, M: int, label: str, cfg: dict):
    """Configurations that compile to the same kernel: every Super shape specialises alike (N, K, strides multiples
    of 16), STREAM_K's share ints are not specialised; today's configuration follows the shape (GEMV_CHOICES)."""
    if not cfg.get("STREAM_K"):
        return (fam, name, M, label)
    return (fam, M, json.dumps({k: v for k, v in cfg.items() if k != "STREAM_K"}, sort_keys=True))


_worker_weights: dict = {}


def _compile_job(job) -> str:
    """One call of one configuration in a worker process: Triton compiles it into the shared on-disk cache."""
    fam_name, name, N, K, M, label, cfg = job
    try:
        fam = Family(fam_name)
        if _worker_weights.get("key") != (fam_name, N, K):
            _worker_weights.clear()
            _worker_weights.update(key=(fam_name, N, K), ws=fam.weights(N, K, 1, seed=N + K))
        x = torch.randn(M, K, device=DEV).bfloat16()
        fam.fn(cfg, x)(*_worker_weights["ws"][0])
        if CUDA:
            torch.cuda.synchronize()
        return ""
    except Exception as ex:  # noqa: BLE001 - the timed pass reports it
        return f"{fam_name} {name} M={M} {label}: {type(ex).__name__}"


def precompile(passes, only, workers: int, variants_of=None) -> None:
    """Every distinct compilation of the run, made by `workers` processes before anything is timed (Triton's cache is
    on disk, so the timing process then loads instead of compiling: ~0.5 s a kernel sequentially, ~150 kernels)."""
    jobs, seen = [], set()
    for fam_name, ms in passes:
        if fam_name == "bf16":
            continue
        fam = Family(fam_name)
        for name, N, K, _ in fam.shapes():
            if only and name not in only:
                continue
            for M in ms:
                vs = variants_of(fam_name, name, M, N, K) if variants_of else fam.variants(M, N, K)
                for label, cfg in vs.items():
                    key = _compile_key(fam_name, name, M, label, cfg)
                    if key not in seen:
                        seen.add(key)
                        jobs.append((fam_name, name, N, K, M, label, cfg))
    t = time.time()
    import multiprocessing as mp
    try:
        with mp.get_context("spawn").Pool(workers) as pool:
            errs = [e for e in pool.map(_compile_job, sorted(jobs, key=lambda j: (j[2], j[3])), chunksize=1) if e]
    except Exception as ex:  # noqa: BLE001 - the timed pass then compiles as it goes
        print(f"  precompile failed ({type(ex).__name__}: {str(ex)[:120]}); compiling as the run goes", flush=True)
        return
    print(f"  precompiled {len(jobs)} distinct configurations in {time.time() - t:.0f} s with {workers} processes"
          + (f"; {len(errs)} raised (reported below when timed)" if errs else ""), flush=True)


def _copies(nb):
    return 1 if not CUDA else min(64, max(2, (256 << 20) // nb + 1))


def run_pass(fam: Family, ms, budget_s, hbm, rows, checks, t0, only, dump, must_fail: set) -> bool:
    for name, N, K, per_token in fam.shapes():
        if only and name not in only:
            continue
        copies = _copies(fam.bytes(N, K, 1))
        ws = fam.weights(N, K, copies, seed=N + K)
        for M in ms:
            # its own seed: drawn from the global generator, x (and the check's error, ~3-5e-3 for fp8 against TOL)
            # depended on what ran before in the process (CI, session 15: 5.09e-3 once, in a test run's order)
            x = torch.randn(M, K, device=DEV, generator=torch.Generator(device=DEV).manual_seed(N + K + M)).bfloat16()
            ref = fam.twin(x, ws[0])
            for label, cfg in fam.variants(M, N, K).items():
                if time.time() - t0 > budget_s:
                    print(f"  budget of {budget_s:.0f} s spent: {fam.name} {name} M={M} {label} and after not timed",
                          flush=True)
                    return False
                fn = fam.fn(cfg, x)
                try:
                    e = rel_err(fn(*ws[0]), ref)
                    if fam.name != "bf16" and fam.name not in must_fail and cuts_rows(M, N, K, cfg, fam.name == "fp8"):
                        bad = rel_err(fn(*fam.broken(ws[0])), ref)
                        checks.append(dict(check=f"must-fail: {fam.name} {name} M={M} {label}, broken weights",
                                           rel_err=bad, ok=bad > 0.1))
                        must_fail.add(fam.name)
                except Exception as ex:  # noqa: BLE001 - one failing variant must not hide the others
                    print(f"  {fam.name} {name} M={M} {label} FAILED: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    checks.append(dict(check=f"{fam.name} {name} M={M} {label}", rel_err=float("inf"), ok=False,
                                       error=f"{type(ex).__name__}: {str(ex)[:300]}"))
                    continue
                tol = 2e-2 if fam.name == "bf16" else TOL    # cuBLAS: bf16 products of bf16 weights, fp32 twin
                checks.append(dict(check=f"{fam.name} {name} M={M} {label}", rel_err=e, ok=e < tol))
                if not e < tol:
                    print(f"  {fam.name} {name} M={M} {label} WRONG: rel err {e:.2e}", flush=True)
                    continue
                try:
                    sec = time_graph(lambda i: fn(*ws[i % copies]), 2 * copies)
                except Exception as ex:  # noqa: BLE001
                    print(f"  {fam.name} {name} M={M} {label} timing FAILED: {type(ex).__name__}: {str(ex)[:200]}",
                          flush=True)
                    continue
                # again after hundreds of graph replays: a race in the partials' join or a counter left non-zero
                # shows here (no share is then last and y keeps torch.empty's garbage)
                e_after = rel_err(fn(*ws[0]), ref)
                if not e_after < tol:
                    checks.append(dict(check=f"{fam.name} {name} M={M} {label} after timing", rel_err=e_after,
                                       ok=False))
                    print(f"  {fam.name} {name} M={M} {label} WRONG after timing: rel err {e_after:.2e}", flush=True)
                    continue
                nb = fam.bytes(N, K, M)
                row = dict(op=fam.op, family=fam.name, shape=name, N=N, K=K, M=M, variant=label, us=sec * 1e6,
                           pct=100 * nb / sec / hbm, bytes=nb, rel_err=max(e, e_after),
                           launches=fam.launches(M, N, K, cfg), per_token=per_token, config=cfg)
                rows.append(row)
                print(f"  {fam.name:5s} {name:15s} M={M} {label:22s} {row['us']:7.1f} us {row['pct']:4.0f}%  "
                      f"launches {row['launches']}  err {row['rel_err']:.1e}", flush=True)
        del ws
        dump()
    return True


def summary(rows) -> dict:
    best, today = {}, {}
    for r in rows:
        k = (r["family"], r["shape"], r["M"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
        if r["variant"] in ("today", "cuBLAS F.linear"):
            today[k] = r
    choices: dict = {}
    for fam in dict.fromkeys(r["family"] for r in rows):
        print(f"\n== {fam}: today vs best variant (us, % of D2D; M = 1 per-token sums over the 88-layer Super) ==")
        print(f"  {'shape':15s} M  {'today':>13s}  {'best':>13s}  variant")
        sums = [0.0, 0.0]
        for (f, shape, M), b in sorted(best.items(), key=lambda kv: (kv[0][2], kv[0][1])):
            if f != fam:
                continue
            d = today.get((f, shape, M))
            dt = f"{d['us']:6.1f} {d['pct']:3.0f}%" if d else "      -     "
            print(f"  {shape:15s} {M}  {dt:>13s}  {b['us']:6.1f} {b['pct']:3.0f}%  {b['variant']}")
            if M == 1 and d:
                sums[0] += d["us"] * d["per_token"]
                sums[1] += b["us"] * b["per_token"]
            if fam == "nvfp4" and d and b["variant"] != "today" and b["us"] <= MARGIN * d["us"]:
                choices[(g._arch(torch.device(DEV)), triton.next_power_of_2(M), b["N"], b["K"])] = b["config"]
        print(f"  M = 1 per token: today {sums[0] / 1e3:.2f} ms, best {sums[1] / 1e3:.2f} ms")
    print("\n== STREAM_K choices (NVFP4, >= 3 % faster than today; for GEMV_CHOICES) ==")
    for k, v in choices.items():
        print(f"    {k}: {v!r},")
    return choices


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemv_streamk.json"))
    ap.add_argument("--budget-s", type=float, default=180.0)
    ap.add_argument("--only", default="", help="comma-separated shape names")
    ap.add_argument("--precompile", type=int, default=12 if CUDA else 0,
                    help="processes that compile every configuration before the timing (0: compile as it goes)")
    ap.add_argument("--passes", default=",".join(p.replace(",", "+") for p in PASSES),
                    help="family:M+M,... in order (default: %(default)s)")
    a = ap.parse_args(argv)
    t0 = time.time()
    env = dict(gpu=torch.cuda.get_device_name(0) if CUDA else "none (CPU smoke run, TRITON_INTERPRET=1)",
               sms=_n_sm(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print("env", env, flush=True)
    d2d = ceiling_d2d()
    print(f"D2D {d2d / 1e9:.0f} GB/s", flush=True)
    rows, checks, must_fail = [], [], set()
    only = set(s for s in a.only.split(",") if s)

    def dump(done=False, **extra):
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(env=env, d2d_GBps=d2d / 1e9, rows=rows, checks=checks, complete=done, **extra), f,
                      indent=1, default=str)

    passes = [(p.split(":")[0], [int(m) for m in p.split(":")[1].split("+")]) for p in a.passes.split(",")]
    if a.precompile > 0:
        precompile(passes, only, a.precompile)
    done = True
    for p in a.passes.split(","):
        fam, ms = p.split(":")
        print(f"-- pass {fam} M={ms} at {time.time() - t0:.0f} s", flush=True)
        if not run_pass(Family(fam), [int(m) for m in ms.split("+")], a.budget_s, d2d, rows, checks, t0, only, dump,
                        must_fail):
            done = False
            break
    choices = summary(rows)
    bad = [c for c in checks if not c["ok"]]
    print(f"\n== correctness at full size: {len(checks) - len(bad)} ok, {len(bad)} BAD; must-fail twins run: "
          f"{sorted(must_fail)} ==")
    for c in bad:
        print(f"  BAD {c['check']}: " + (c.get("error") or f"rel err {c['rel_err']:.2e}"))
    dump(done, choices={str(k): v for k, v in choices.items()})
    print(f"wrote {a.out}; total {time.time() - t0:.0f} s")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
