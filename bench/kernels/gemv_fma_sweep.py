"""The NVFP4 decode GEMV on the CUDA cores (kernels/gemv_nvfp4_fma.py) beside the tensor-core GEMV ("today": the
shape's GEMV_CHOICES entry without its FMA key) and the read probe, at every Super shape, M = 1, 2 (FMA) and 4, 8
(today's only), with the read and D2D ceilings of the same run; "routed" is nvfp4_linear as the engine calls it
(the FMA kernel where GEMV_CHOICES says 'FMA': session 13, h-fmaroute), timed where it differs from "today".

    python -m bench.kernels.gemv_fma_sweep [--budget-s 125] [--out gemv_fma.json] [--only SHAPE,..] [--precompile 12]
        [--fp8]     # session 36: the FP8 GEMV instead (kernels/gemv_fp8_fma.py against the tensor-core fp8_linear and
                    # fp8_linear as routed), on the FP8 modules' Super shapes, M = 1, 2
        [--bf16]    # session 36: the bf16 GEMV (F.linear, cuBLAS; a Triton candidate) on the bf16 modules' shapes

Method as bench.kernels.gemv_streamk_sweep: each call graph-captured over weight copies rotated through ~4x the L2,
median of CUDA events (bench.kernels.common.time_graph); % of the read ceiling measured first in this run
(bench.kernels.common.ceiling_read: a kernel that only reads; session 12's read probe beat the D2D copy's rate, so a
read-only GEMV is quoted against a read), the D2D copy's % printed beside it. Every
variant is checked against the fp32 twin at full size (bf16 out, 5e-3) before and after its timing; a must-fail
twin (nibbles swapped) per M shows the check catches a wrong decode. The read probe (same grid and loads, no decode)
is timed, not checked. Distinct compilations are made first by worker processes (Triton's on-disk cache). The budget
guard stops timing and keeps what was measured; the JSON is rewritten after every shape; the table comes last.
On a CPU it runs one tiny shape under Triton's interpreter (a smoke test of the script).
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

from bench.kernels.common import DEV, ceiling_d2d, ceiling_read, time_graph, report_checks  # noqa: E402
from kernels import gemv_nvfp4_fma as fma  # noqa: E402
from kernels import gemv_fp8_fma as fp8fma  # noqa: E402
from bench.kernels.gemv_nvfp4_sweep import FP8_SHAPES, _weights as weights  # noqa: E402
from kernels import gemv_nvfp4 as g  # noqa: E402
from kernels.nvfp4 import swap_nibbles  # noqa: E402
from kernels.testing import rel_err  # noqa: E402

CUDA = DEV == "cuda"
TOL = 5e-3
# (name, N, K, calls per decode token of the 88-layer Super)
SHAPES = [("mamba.in_proj", 18560, 4096, 40), ("mamba.out_proj", 4096, 8192, 40), ("attn.q/o", 4096, 4096, 16),
          ("shared.up", 5376, 4096, 40), ("shared.down", 4096, 5376, 40), ("fc1_latent", 1024, 4096, 40),
          ("fc2_latent", 4096, 1024, 40), ("lm_head", 131072, 4096, 1)]
SMOKE_SHAPES = [("smoke", 40, 1024, 1)]
MS = (1, 2, 4, 8)
ROUTED = {"ROUTED": True}


class Nvfp4Fma:
    """The NVFP4 GEMV: kernels/gemv_nvfp4_fma.py against the tensor-core nvfp4_linear (session 12)."""
    title = "NVFP4 GEMV"
    ms = MS
    shapes = SHAPES

    @staticmethod
    def variants(M: int, N: int, K: int) -> dict[str, dict | None]:
        """label -> None (the tensor-core nvfp4_linear), ROUTED (nvfp4_linear as the engine calls it, where that is
        the FMA kernel) or an FMA config ({} = fma_config's default); 'probe' = the read probe, default FMA grid."""
        v: dict[str, dict | None] = {"today": None}
        if Nvfp4Fma.routed(M, N, K) is not None:
            v["routed"] = ROUTED
        if M > 2:
            return v
        v["fma"] = {}
        if M == 1:
            v["fma C4 R2 pps2"] = dict(C=4, R=2, PPS=2)
            v["fma C4 R1 pps4"] = dict(C=4, R=1, PPS=4)
            v["fma C2 R2 pps4"] = dict(C=2, R=2, PPS=4)
            v["fma C1 R4 pps6"] = dict(C=1, R=4, PPS=6)
        else:
            v["fma C2 R2 pps2"] = dict(C=2, R=2, PPS=2)
            v["fma C1 R2 pps8"] = dict(C=1, R=2, PPS=8)
        v["probe"] = dict(PROBE=True)
        return v

    @staticmethod
    def routed(M, N, K):
        """The FMA config nvfp4_linear routes this shape to on this device (None: the tensor cores)."""
        return g.gemv_config(M, N, K, torch.device(DEV)).get("FMA")

    @staticmethod
    def call(cfg, x):
        if cfg is None:     # the tensor cores: a config naming FMA as None keeps the entry's tensor-core keys
            return lambda q, s, gs: g.nvfp4_linear(x, q, s, gs, config={"FMA": None})
        if cfg is ROUTED:
            return lambda q, s, gs: g.nvfp4_linear(x, q, s, gs)
        c = {k: v for k, v in cfg.items() if k != "PROBE"}
        return lambda q, s, gs: fma.nvfp4_linear_fma(x, q, s, gs, config=c, probe=cfg.get("PROBE", False))

    @staticmethod
    def config(M, N, K, cfg):
        return fma.fma_config(M, N, K, torch.device(DEV), cfg)

    @staticmethod
    def nbytes(N, K, M):
        return N * K // 2 + N * K // 16 + M * K * 2 + M * N * 2

    @staticmethod
    def weights(N, K, copies, seed):
        return weights(N, K, copies, seed)

    @staticmethod
    def twin(x, w):
        return g.nvfp4_linear_torch(x, *w, out_dtype=torch.float32)

    broken_what = "swapped nibbles"

    @staticmethod
    def broken(w):
        return (swap_nibbles(w[0]), *w[1:])


class Fp8Fma:
    """The FP8 GEMV (session 36): kernels/gemv_fp8_fma.py against kernels.gemv_nvfp4's tensor-core fp8_linear
    (FP8_GEMV_CHOICES' tensor-core keys), and fp8_linear as the engine calls it ("routed": the FMA kernel at M = 1),
    on the shapes the Super checkpoint keeps in FP8."""
    title = "FP8 GEMV"
    ms = (1, 2)
    shapes = FP8_SHAPES

    @staticmethod
    def variants(M: int, N: int, K: int) -> dict[str, dict | None]:
        v: dict[str, dict | None] = {"today": None, "fma": {}}
        if Fp8Fma.routed(M, N, K) is not None:
            v["routed"] = ROUTED
        if M == 1:      # call 1 (H100): C 4 > 2 > 1 everywhere, 8 warps and R 2 no better; C 8 new in call 2
            v["fma C4 R1 pps5"] = dict(C=4, R=1, PPS=5)
            v["fma C4 R1 pps4"] = dict(C=4, R=1, PPS=4)
            v["fma C8 R1 pps2"] = dict(C=8, R=1, PPS=2)
            v["fma C8 R1 pps3 evict"] = dict(C=8, R=1, PPS=3, EVICT=True)
            v["fma C4 R1 pps5 evict"] = dict(C=4, R=1, PPS=5, EVICT=True)
            v["fma C8 R2 pps2"] = dict(C=8, R=2, PPS=2)
            v["probe C4 pps5"] = dict(C=4, R=1, PPS=5, PROBE=True)
        else:
            v["fma C2 R2 pps4"] = dict(C=2, R=2, PPS=4)
        v["probe"] = dict(PROBE=True)
        return v

    @staticmethod
    def routed(M, N, K):
        """The FMA config fp8_linear routes this shape to on this device (None: the tensor cores)."""
        return g.fp8_gemv_config(N, K, torch.device(DEV), M=M).get("FMA")

    @staticmethod
    def call(cfg, x):
        if cfg is None:     # the tensor cores: a config naming FMA as None keeps the entry's tensor-core keys
            return lambda w, sc: g.fp8_linear(x, w, sc, config={"FMA": None})
        if cfg is ROUTED:
            return lambda w, sc: g.fp8_linear(x, w, sc)
        c = {k: v for k, v in cfg.items() if k != "PROBE"}
        return lambda w, sc: fp8fma.fp8_linear_fma(x, w, sc, config=c, probe=cfg.get("PROBE", False))

    @staticmethod
    def config(M, N, K, cfg):
        return fp8fma.fp8_fma_config(M, N, K, torch.device(DEV), cfg)

    @staticmethod
    def nbytes(N, K, M):
        return N * K + M * K * 2 + M * N * 2

    @staticmethod
    def weights(N, K, copies, seed):
        """e4m3 codes over the whole range but NaN (0x7F / 0xFF -> 448 / -448: the fp16 sums' worst case)."""
        gen = torch.Generator(device=DEV).manual_seed(seed)
        out = []
        for _ in range(copies):
            b = torch.randint(0, 256, (N, K), dtype=torch.uint8, device=DEV, generator=gen)
            b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
            out.append((b.view(torch.float8_e4m3fn), torch.tensor(2e-3, device=DEV)))
        return out

    @staticmethod
    def twin(x, w):
        return g.fp8_linear_torch(x, *w, out_dtype=torch.float32)

    broken_what = "codes swapped in pairs"

    @staticmethod
    def broken(w):       # each code moved to its pair neighbour's x: a wrong pairing of weights and x
        b = w[0].view(torch.uint8)
        return (b.view(-1, 2).flip(1).reshape(b.shape).view(torch.float8_e4m3fn), w[1])


class Bf16:
    """The bf16 GEMV (session 36): what the real Super keeps in bf16 (q/k/v/o but two o, the latent fc1 / fc2 but four,
    12 in_proj, 11 out_proj, the lm_head: ~4.8 GB a token, as much as its FP8) runs through F.linear (cuBLAS) at
    M = 1; measured here beside the read ceiling, with kernels/gemv_bf16.py's Triton GEMV."""
    title = "bf16 GEMV"
    ms = (1,)
    shapes = [("mamba.in_proj", 18560, 4096, 12), ("mamba.out_proj", 4096, 8192, 11), ("attn.q/o", 4096, 4096, 14),
              ("attn.k/v", 256, 4096, 16), ("fc1_latent", 1024, 4096, 37), ("fc2_latent", 4096, 1024, 39),
              ("lm_head", 131072, 4096, 1)]
    broken_what = "K reversed"

    @staticmethod
    def variants(M, N, K):
        v = {"today": None, "fma triton": {}}       # (the summary's "best fma" column: kernels/gemv_bf16.py)
        if Bf16.routed(M, N, K) is not None:
            v["routed"] = ROUTED
        return v

    @staticmethod
    def routed(M, N, K):
        """The bf16_gemv keywords `linear` routes this shape to on this device (None: F.linear)."""
        from kernels.gemv_bf16 import BF16_GEMV_CHOICES
        return BF16_GEMV_CHOICES.get((g._arch(torch.device(DEV)), M, N, K))

    @staticmethod
    def call(cfg, x):
        if cfg is None:
            return lambda w: torch.nn.functional.linear(x, w)
        if cfg is ROUTED:
            from kernels.linear import QuantizedWeight, linear
            return lambda w: linear(x, QuantizedWeight("dense", w))
        from kernels.gemv_bf16 import bf16_gemv
        return lambda w: bf16_gemv(x, w).to(x.dtype)

    @staticmethod
    def config(M, N, K, cfg):
        return dict(programs=triton.cdiv(N, 128), SLICES=1)

    @staticmethod
    def nbytes(N, K, M):
        return N * K * 2 + M * K * 2 + M * N * 2

    @staticmethod
    def weights(N, K, copies, seed):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        return [(torch.randn(N, K, device=DEV, generator=gen).bfloat16(),) for _ in range(copies)]

    @staticmethod
    def twin(x, w):
        return x.float() @ w[0].float().t()

    @staticmethod
    def broken(w):
        return (w[0].flip(1),)


FAMILIES = {"nvfp4": Nvfp4Fma, "fp8": Fp8Fma, "bf16": Bf16}


def copies_for(nb):
    return 1 if not CUDA else min(64, max(2, (256 << 20) // nb + 1))


def _compile_job(job):
    fam, name, N, K, M, label, cfg = job
    fam = FAMILIES[fam]
    try:
        w, = fam.weights(N, K, 1, seed=1)
        fam.call(cfg, torch.randn(M, K, device=DEV).bfloat16())(*w)
        if CUDA:
            torch.cuda.synchronize()
        return ""
    except Exception as ex:  # noqa: BLE001 - the timed pass reports it
        return f"{name} M={M} {label}: {type(ex).__name__}: {str(ex)[:120]}"


def precompile(fam, shapes, workers):
    """Every variant's first call in `workers` spawned processes (Triton caches the compilations on disk)."""
    key_of = {v: k for k, v in FAMILIES.items()}[fam]
    jobs, seen = [], set()
    for name, N, K, _ in shapes:
        for M in fam.ms:
            for label, cfg in fam.variants(M, N, K).items():
                key = (name, M, label) if cfg is None or cfg is ROUTED else (min(M, 2), json.dumps(cfg, sort_keys=True))
                if key not in seen:
                    seen.add(key)
                    jobs.append((key_of, name, N, K, M, label, cfg))
    t = time.time()
    import multiprocessing as mp
    try:
        with mp.get_context("spawn").Pool(workers) as pool:
            errs = [e for e in pool.map(_compile_job, jobs, chunksize=1) if e]
    except Exception as ex:  # noqa: BLE001
        print(f"  precompile failed ({type(ex).__name__}: {str(ex)[:120]}); compiling as the run goes", flush=True)
        return
    print(f"  precompiled {len(jobs)} configurations in {time.time() - t:.0f} s ({workers} processes)"
          + "".join(f"\n    raised: {e}" for e in errs), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemv_fma.json"))
    ap.add_argument("--budget-s", type=float, default=125.0)
    ap.add_argument("--only", default="")
    ap.add_argument("--precompile", type=int, default=12 if CUDA else 0)
    ap.add_argument("--fp8", action="store_true", help="the FP8 GEMV (kernels/gemv_fp8_fma.py) instead")
    ap.add_argument("--bf16", action="store_true", help="the bf16 GEMV (cuBLAS, the Triton candidate) instead")
    a = ap.parse_args(argv)
    fam = Fp8Fma if a.fp8 else Bf16 if a.bf16 else Nvfp4Fma
    t0 = time.time()
    env = dict(gpu=torch.cuda.get_device_name(0) if CUDA else "none (CPU smoke run, TRITON_INTERPRET=1)",
               torch=torch.__version__, triton=triton.__version__, family=fam.title,
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print("env", env, flush=True)
    shapes = fam.shapes if CUDA else SMOKE_SHAPES
    only = set(x for x in a.only.split(",") if x)
    shapes = [sh for sh in shapes if not only or sh[0] in only]
    if a.precompile > 0:
        precompile(fam, shapes, a.precompile)
    read, d2d = ceiling_read(), ceiling_d2d()
    print(f"read {read / 1e9:.0f} GB/s, D2D {d2d / 1e9:.0f} GB/s (at {time.time() - t0:.0f} s)", flush=True)
    rows, checks = [], []

    def dump(done=False):
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(dict(env=env, read_GBps=read / 1e9, d2d_GBps=d2d / 1e9, rows=rows, checks=checks, complete=done),
                      fh, indent=1, default=str)

    done = True
    for name, N, K, per_token in shapes:
        copies = copies_for(fam.nbytes(N, K, 1))
        ws = fam.weights(N, K, copies, seed=N + K)
        for M in fam.ms:
            x = torch.randn(M, K, device=DEV).bfloat16()
            ref = fam.twin(x, ws[0])
            if M <= 2:      # the must-fail twin, once per shape and M, through the FMA default
                bad = rel_err(fam.call({}, x)(*fam.broken(ws[0])), ref)
                checks.append(dict(check=f"must-fail fma {name} M={M} {fam.broken_what}", rel_err=bad, ok=bad > 0.1))
            for label, cfg in fam.variants(M, N, K).items():
                if time.time() - t0 > a.budget_s:
                    print(f"  budget of {a.budget_s:.0f} s spent: {name} M={M} {label} and after not timed", flush=True)
                    done = False
                    break
                fn = fam.call(cfg, x)
                probe = bool(cfg and cfg.get("PROBE"))
                try:
                    e = 0.0 if probe else rel_err(fn(*ws[0]), ref)
                    if not probe:
                        checks.append(dict(check=f"{name} M={M} {label}", rel_err=e, ok=e < TOL))
                        if not e < TOL:
                            print(f"  {name} M={M} {label} WRONG: rel err {e:.2e}", flush=True)
                            continue
                    sec = time_graph(lambda i: fn(*ws[i % copies]), 2 * copies)
                    e_after = 0.0 if probe else rel_err(fn(*ws[0]), ref)
                    if not probe:
                        checks.append(dict(check=f"{name} M={M} {label} after timing", rel_err=e_after,
                                           ok=e_after < TOL))
                except Exception as ex:  # noqa: BLE001 - one failing variant must not hide the others
                    print(f"  {name} M={M} {label} FAILED: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    checks.append(dict(check=f"{name} M={M} {label}", rel_err=float("inf"), ok=False,
                                       error=f"{type(ex).__name__}: {str(ex)[:300]}"))
                    continue
                nb = fam.nbytes(N, K, M)
                fcfg = fam.routed(M, N, K) if cfg is ROUTED else cfg
                c = None if fcfg is None else fam.config(M, N, K, {k: v for k, v in fcfg.items() if k != "PROBE"})
                row = dict(shape=name, N=N, K=K, M=M, variant=label, us=sec * 1e6, pct=100 * nb / sec / read,
                           pct_d2d=100 * nb / sec / d2d, bytes=nb, rel_err=max(e, e_after), per_token=per_token,
                           config=fcfg, grid=None if c is None else (c["programs"], c["SLICES"]))
                rows.append(row)
                print(f"  {name:15s} M={M} {label:18s} {row['us']:7.1f} us {row['pct']:4.0f}% read "
                      f"({row['pct_d2d']:3.0f}% D2D)  err {row['rel_err']:.1e}"
                      + (f"  grid {row['grid']}" if c else ""), flush=True)
            else:
                continue
            break
        ws = None      # (the next shape's copies replace these)
        dump()
        if not done:
            break
    summary(rows, fam)
    bad = report_checks(checks)
    dump(done)
    print(f"wrote {a.out}; total {time.time() - t0:.0f} s")
    return 0 if not bad else 1


def summary(rows, fam=Nvfp4Fma):
    """Per shape and M: today, the best FMA variant, the read probe, the engine's route (µs, % of the read ceiling);
    M = 1 per-token sums."""
    print(f"\n== {fam.title}: today (tensor cores) vs FMA (CUDA cores) vs read probe (µs, % of the read ceiling) ==")
    print(f"  {'shape':15s} M  {'today':>12s}  {'best fma':>12s}  {'probe':>12s}  {'routed':>12s}  fma variant")
    sums = [0.0, 0.0, 0.0]
    for name, N, K, per_token in fam.shapes if CUDA else SMOKE_SHAPES:
        for M in fam.ms:
            rs = [r for r in rows if r["shape"] == name and r["M"] == M]
            if not rs:
                continue
            t = next((r for r in rs if r["variant"] == "today"), None)
            fs = [r for r in rs if r["variant"].startswith("fma")]
            b = min(fs, key=lambda r: r["us"]) if fs else None
            p = next((r for r in rs if r["variant"] == "probe"), None)      # the default grid's
            rt = next((r for r in rs if r["variant"] == "routed"), t)

            def cell(r):
                return f"{r['us']:6.1f} {r['pct']:3.0f}%" if r else "      -     "
            print(f"  {name:15s} {M}  {cell(t):>12s}  {cell(b):>12s}  {cell(p):>12s}  {cell(rt):>12s}  "
                  f"{b['variant'] if b else ''}")
            if M == 1 and t and b and rt:
                sums[0] += t["us"] * per_token
                sums[1] += min(b["us"], t["us"]) * per_token
                sums[2] += rt["us"] * per_token
    print(f"  M = 1 per 88-layer token: today {sums[0] / 1e3:.2f} ms, with the FMA where faster {sums[1] / 1e3:.2f} ms,"
          f" as routed {sums[2] / 1e3:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
