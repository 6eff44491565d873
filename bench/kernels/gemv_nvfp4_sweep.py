"""The dense NVFP4 GEMV's fixed cost per call (issue 19, part 1): every Super decode shape at M = 1 and 8, the
default (kernels.gemv_nvfp4.gemv_config) beside the variants that remove launches, in one run with its own read
ceiling (bench.kernels.common.ceiling_read; the D2D copy's beside it).

    python -m bench.kernels.gemv_nvfp4_sweep [--out gemv.json] [--budget-s 140] [--only SHAPE,SHAPE] [--counts]
        [--fp8]      # the FP8 GEMV instead: its Super shapes, default / build / last / build+last / last s4x1

Launches per call today (M = 1): the x-operand kernel, then for a split K a zero-fill, the GEMV with fp32 atomics
and a cast to bf16 — 2 to 4 launches for one GEMV. The variants (flags of kernels.gemv_nvfp4, defaults unchanged):
  build   X_BUILD: B built in the GEMV from x and a 0/1 pattern, no x launch;
  last    SPLIT_REDUCE 1: split-K partials, the last split to arrive sums them and stores bf16 (no zero-fill, no cast);
  sPxT    split_k_for(programs_per_sm=P, min_tiles=T, even=True): more splits once a split costs no launch;
  st4 / rNN / one-dot / BN..: a deeper cp.async pipeline, a register cap (maxnreg: more programs per SM), one
          dot per K-tile (ONE_DOT), other row blocks and warps;
  x given: the x operands made outside the timed call, i.e. the GEMV alone (what sharing one x across q/k/v or
           shared-up/fc1 saves per extra GEMV).
Method as bench/kernels/gemv_nvfp4.py: each call graph-captured many times over weight copies rotated through
~4x the L2, median of CUDA events; % of the read ceiling measured in this run (a kernel that only reads: session
12's read probe beat the D2D copy's rate, 102 % at the lm_head, so a read-only GEMV is quoted against a read), the
D2D copy's % beside it. "default" is the engine's call: at M = 1 on sm_90 that is the FMA GEMV where GEMV_CHOICES
routes it (kernels/gemv_nvfp4_fma.py); every other variant names tensor-core keys and so runs the tensor cores.
Every variant is checked against the PyTorch twin at the full shape (fresh random inputs, bf16 as timed) before it
is timed; a variant that fails or raises is reported, not timed; one must-fail twin (swapped nibbles) shows the
check catches a broken decode.
Prints a table and the per-shape winners as a `GEMV_CHOICES` dict for kernels/gemv_nvfp4.py.
--counts prints the bytes, programs, K-tiles per program and launches per call of every shape (no GPU needed).
On a CPU the whole script runs as a smoke test under Triton's interpreter on tiny shapes.
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
from kernels.gemv_nvfp4 import (_arch, fp8_gemv_config, fp8_linear, fp8_linear_torch, gemv_config,  # noqa: E402
                                 nvfp4_linear, nvfp4_linear_torch, split_k_for, x_operands)
from kernels.nvfp4 import swap_nibbles  # noqa: E402
from kernels.testing import rel_err  # noqa: E402

CUDA = DEV == "cuda"
# bf16 y against the fp32 twin: bf16's rounding alone is ~1.1e-3 (round to nearest, the GPU; 2.2e-3 where the
# interpreter truncates); one wrong 16-group of a 4,096 row is ~6e-2, a lost split ~0.3. The fp32 bound (2e-5) is
# the CPU tests' job: checking fp32 here would compile every variant twice (the output dtype is in the signature).
TOL = 5e-3
# (name, N, K, calls per decode token of the 88-layer Super: 40 Mamba, 40 MoE, 8 attention layers, one lm_head)
SHAPES = [("mamba.in_proj", 18560, 4096, 40), ("mamba.out_proj", 4096, 8192, 40), ("attn.q/o", 4096, 4096, 16),
          ("attn.k/v", 256, 4096, 16), ("shared.up", 5376, 4096, 40), ("shared.down", 4096, 5376, 40),
          ("fc1_latent", 1024, 4096, 40), ("fc2_latent", 4096, 1024, 40), ("lm_head", 131072, 4096, 1)]
SMOKE_SHAPES = [("in_proj-like", 160, 512, 40), ("latent-like", 24, 1024, 40), ("odd", 37, 272, 1)]
# GEMVs of one decode token that could reuse another's x operands: k and v take q's (8 attention layers), the
# latent fc1 takes the shared expert's up (40 MoE layers); every other GEMV's x is its own
SHARED_X = {"attn.k/v": 16, "fc1_latent": 40}
FLAG_DEFAULTS = dict(X_INLINE=False, X_BUILD=False, SPLIT_REDUCE=0, ONE_DOT=False)
MARGIN = 0.97       # a variant replaces the default in GEMV_CHOICES only if at least 3 % faster (run-to-run ~2 %)


def _split(N, K, block_n, n_sm, per_sm, min_tiles):
    return split_k_for(N, K, block_n, 256, n_sm, programs_per_sm=per_sm, min_tiles=min_tiles, even=True)


def variants(M: int, N: int, K: int, n_sm: int) -> dict[str, dict]:
    """label -> config for nvfp4_linear ({} = gemv_config's default); 'XB' = the x operands prepared outside."""
    base = gemv_config(M, N, K, torch.device(DEV), n_sm)
    bn = base["BLOCK_N"]
    v: dict[str, dict] = {"default": {}}
    if not base.get("X_INLINE"):
        v["x given (GEMV alone)"] = dict(XB=True)
    bl = dict(X_BUILD=True, X_INLINE=False, SPLIT_REDUCE=1)
    v["build"] = dict(X_BUILD=True, X_INLINE=False)
    v["last"] = dict(SPLIT_REDUCE=1)
    v["build+last"] = dict(bl)
    v["build+last s2x1"] = dict(bl, SPLIT_K=_split(N, K, bn, n_sm, 2, 1))
    v["build+last s4x1"] = dict(bl, SPLIT_K=_split(N, K, bn, n_sm, 4, 1))
    # 8 per SM: more programs than fit at once, so the SMs' shares even out (in_proj: 290 programs leave 3 on some
    # SMs, 2.2 on average); free to try: SPLIT_REDUCE compiles once for every split count
    v["build+last s8x1"] = dict(bl, SPLIT_K=_split(N, K, bn, n_sm, 8, 1))
    # x as today with more splits: under the device's Triton 3.6 the built B costs 0.3 (BN64) to 1.3 (BN128)
    # instructions per weight, SPLIT_REDUCE nothing (bench.kernels.gemv_nvfp4_sass); the same kernel as "last"
    v["last s4x1"] = dict(SPLIT_REDUCE=1, SPLIT_K=_split(N, K, bn, n_sm, 4, 1))
    v["last s8x1"] = dict(SPLIT_REDUCE=1, SPLIT_K=_split(N, K, bn, n_sm, 8, 1))
    if M == 1:
        v["build+last s4x1 st4"] = dict(bl, SPLIT_K=_split(N, K, bn, n_sm, 4, 1), num_stages=4)
        v["build+last s4x1 r80"] = dict(bl, SPLIT_K=_split(N, K, bn, n_sm, 4, 1), maxnreg=80)
        v["build+last s4x1 one-dot"] = dict(bl, SPLIT_K=_split(N, K, bn, n_sm, 4, 1), ONE_DOT=True)
        v["build+last BN128 s4x1"] = dict(bl, BLOCK_N=128, SPLIT_K=_split(N, K, 128, n_sm, 4, 1))
        v["build+last BN128 s4x1 r128"] = dict(bl, BLOCK_N=128, SPLIT_K=_split(N, K, 128, n_sm, 4, 1), maxnreg=128)
        v["build+last BN128 w8 s4x1"] = dict(bl, BLOCK_N=128, num_warps=8, SPLIT_K=_split(N, K, 128, n_sm, 4, 1))
        v["build+last BN32 w2 s4x1"] = dict(bl, BLOCK_N=32, num_warps=2, SPLIT_K=_split(N, K, 32, n_sm, 4, 1))
    else:
        other = 64 if bn == 128 else 128
        v[f"build+last BN{other} s4x1"] = dict(bl, BLOCK_N=other, SPLIT_K=_split(N, K, other, n_sm, 4, 1))
        v["build+last s4x1 w8"] = dict(bl, SPLIT_K=_split(N, K, bn, n_sm, 4, 1), num_warps=8)
    return v


def resolved(cfg: dict, M: int, N: int, K: int, n_sm: int | None = None) -> dict:
    """The configuration a variant runs (gemv_config's keys under the variant's), for the table and GEMV_CHOICES."""
    base = gemv_config(M, N, K, torch.device(DEV), n_sm)
    n_sm = base.pop("n_sm")
    c = {**base, **{k: v for k, v in cfg.items() if k != "XB"}}
    if "BLOCK_N" in cfg and "SPLIT_K" not in cfg:
        c["SPLIT_K"] = split_k_for(N, K, c["BLOCK_N"], 256, n_sm)
    return c


def launches(c: dict) -> int:
    """Kernel launches of one call with this configuration (bf16 out)."""
    if c.get("FMA") is not None:
        return 1                                      # the FMA GEMV: one launch, split K joined in it
    n = 1
    if not (c.get("X_INLINE") or c.get("X_BUILD")):
        n += 1                                        # _x_operands_kernel
    if c["SPLIT_K"] > 1 and c.get("SPLIT_REDUCE", 0) != 1:
        n += 2                                        # torch.zeros, and the fp32 -> bf16 cast after the atomics
    return n


def counts(shapes, n_sm: int) -> list[dict]:
    """Bytes, programs, K-tiles per program and launches per call, M = 1 and 8, for the default configuration."""
    rows = []
    for name, N, K, per_token in shapes:
        for M in (1, 8):
            c = resolved({}, M, N, K, n_sm)
            n_blocks = triton.cdiv(N, c["BLOCK_N"])
            tiles = triton.cdiv(K, c["BLOCK_K"])
            per_split = triton.cdiv(tiles, c["SPLIT_K"])
            nb = _bytes(N, K, M)
            # every row block reads the prepared B of all K: 4 J x [BLOCK_K / 4, 16] fp16 per K-tile
            xb = n_blocks * tiles * 32 * c["BLOCK_K"] if not (c.get("X_INLINE") or c.get("X_BUILD")) else 0
            rows.append(dict(shape=name, N=N, K=K, M=M, per_token=per_token, bytes=nb,
                             floor_us=nb / (4.17e12) * 1e6, mode=c["LOAD_MODE"], BLOCK_N=c["BLOCK_N"],
                             programs=n_blocks * c["SPLIT_K"], split=c["SPLIT_K"], tiles_per_program=per_split,
                             programs_per_sm=n_blocks * c["SPLIT_K"] / n_sm, launches=launches(c),
                             x_operand_reads_MB=xb / 1e6))
    return rows


def plan(shapes, ms, n_sm: int, family=None) -> tuple[int, int]:
    """(timed calls, distinct GEMV compilations) of a full run: Triton compiles once per constexpr set (SPLIT_K is
    one, except under NVFP4's SPLIT_REDUCE), and the compiles, not the timings, are most of the run's seconds."""
    family = family or Nvfp4
    keys, n = set(), 0
    for name, N, K, _ in shapes:
        for M in ms:
            for label, cfg in family.variants(M, N, K, n_sm).items():
                c = dict(family.resolved(cfg, M, N, K, n_sm))
                n += 1
                if family is Nvfp4 and c["SPLIT_K"] > 1 and c.get("SPLIT_REDUCE") == 1:
                    c["SPLIT_K"] = 2
                if c["SPLIT_K"] == 1:
                    c.pop("SPLIT_REDUCE", None)
                keys.add((M == 1, min(M, 2) if family is Fp8 else 0, tuple(sorted(c.items()))))
    return n, len(keys)


def _bytes(N, K, M):
    return N * K // 2 + N * K // 16 + M * K * 2 + M * N * 2


def _weights(N, K, copies, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = []
    for _ in range(copies):
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=DEV, generator=g)
        s = torch.randint(0x28, 0x48, (N, K // 16), dtype=torch.uint8, device=DEV, generator=g)
        s = s.view(torch.float8_e4m3fn)       # e4m3 2^-2 .. 2^2, as bench/kernels/gemv_nvfp4.py draws them
        out.append((q, s, torch.tensor(1e-3, device=DEV)))
    return out


def _copies(nb):
    return 1 if not CUDA else min(64, max(2, (256 << 20) // nb + 1))


def _fn(cfg, M, N, K, x, out_dtype=None):
    """fn(q, s, gs) -> y for a variant; 'XB': the operands made here once, outside what is timed."""
    c = {k: v for k, v in cfg.items() if k != "XB"} or None
    xb = None
    if cfg.get("XB"):
        r = resolved(cfg, M, N, K)
        xb = x_operands(x, r["M_PAD"], r["LOAD_MODE"] == 8)
        # prepared operands are the tensor cores' (the FMA GEMV reads x itself), and only a configuration that does
        # not build x in the kernel reads them (session 32: the shapes whose default builds x failed the check)
        c = {"FMA": None, "X_INLINE": False, "X_BUILD": False}
    return lambda q, s, gs: nvfp4_linear(x, q, s, gs, out_dtype=out_dtype, config=c, xb=xb)


class Nvfp4:
    """The NVFP4 GEMV's hooks for `run`."""
    op = "nvfp4 gemv"
    variants = staticmethod(variants)
    resolved = staticmethod(resolved)
    launches = staticmethod(launches)
    bytes = staticmethod(_bytes)
    weights = staticmethod(_weights)
    fn = staticmethod(_fn)

    @staticmethod
    def twin(x, w):
        return nvfp4_linear_torch(x, *w, out_dtype=torch.float32)

    @staticmethod
    def broken(w):                          # the must-fail twin: nibbles swapped
        return (swap_nibbles(w[0]), *w[1:])


# FP8 per-tensor (the real Super checkpoint keeps some in_proj / out_proj, most shared-expert and a few latent
# projections in FP8): the same launches per call (x.T columns, zero-fill, cast), the same two flags
FP8_SHAPES = [("mamba.in_proj", 18560, 4096, 28), ("mamba.out_proj", 4096, 8192, 29), ("shared.up", 5376, 4096, 39),
              ("shared.down", 4096, 5376, 39), ("fc1_latent", 1024, 4096, 3)]


class Fp8:
    """The FP8 GEMV's hooks for `run` (calls per token: the FP8 modules of the Super checkpoint, reference notes)."""
    op = "fp8 gemv"

    @staticmethod
    def variants(M, N, K, n_sm):
        v = {"default": {}, "build": dict(X_BUILD=True), "last": dict(SPLIT_REDUCE=1),
             "build+last": dict(X_BUILD=True, SPLIT_REDUCE=1)}
        v["last s4x1"] = dict(SPLIT_REDUCE=1, SPLIT_K=split_k_for(N, K, 64, 128, n_sm, 4, 1, even=True))
        return v

    @staticmethod
    def resolved(cfg, M, N, K, n_sm=None):
        return fp8_gemv_config(N, K, torch.device(DEV), cfg, n_sm)

    @staticmethod
    def launches(c):
        n = 1 + (0 if c.get("X_BUILD") else 1)              # _x_columns_kernel
        return n + (2 if c["SPLIT_K"] > 1 and c.get("SPLIT_REDUCE", 0) != 1 else 0)

    @staticmethod
    def bytes(N, K, M):
        return N * K + M * K * 2 + M * N * 2

    @staticmethod
    def weights(N, K, copies, seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        # e4m3 bytes with bit 3 of the exponent clear (no NaN, |w| <= 1.75 * 2^-1 .. ), as bench/kernels/gemv_nvfp4.py
        return [(torch.randint(0, 256, (N, K), dtype=torch.uint8, device=DEV, generator=g).bitwise_and(0x77)
                 .view(torch.float8_e4m3fn), torch.tensor(1e-3, device=DEV)) for _ in range(copies)]

    @staticmethod
    def fn(cfg, M, N, K, x):
        return lambda w, sc: fp8_linear(x, w, sc, config=cfg or None)

    @staticmethod
    def twin(x, w):
        return fp8_linear_torch(x, *w, out_dtype=torch.float32)

    @staticmethod
    def broken(w):                          # the must-fail twin: every weight's sign flipped
        return ((w[0].view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn), w[1])


def run(shapes, ms, budget_s, hbm, out_rows, checks, t0, dump=lambda: None, family=Nvfp4, d2d=None):
    """Every variant checked, timed, checked again; pct is % of `hbm` (the read ceiling), pct_d2d of `d2d`."""
    n_sm = gemv_config(1, 1, 256, torch.device(DEV))["n_sm"]
    must_fail_done = False
    for name, N, K, per_token in shapes:
        copies = _copies(family.bytes(N, K, 1))
        ws = family.weights(N, K, copies, seed=N + K)
        for M in ms:
            x = torch.randn(M, K, device=DEV).bfloat16()
            ref = family.twin(x, ws[0])
            for label, cfg in family.variants(M, N, K, n_sm).items():
                if time.time() - t0 > budget_s:
                    print(f"  budget of {budget_s:.0f} s spent: {name} M={M} {label} and after not timed", flush=True)
                    return False
                c = family.resolved(cfg, M, N, K)
                fn = family.fn(cfg, M, N, K, x)
                try:   # the timed call itself (bf16 out: an fp32 check would compile every variant twice)
                    e = rel_err(fn(*ws[0]), ref)
                    if not must_fail_done and c["SPLIT_K"] > 1 and c.get("SPLIT_REDUCE") == 1:
                        bad = rel_err(fn(*family.broken(ws[0])), ref)
                        checks.append(dict(check=f"must-fail: {name} M={M} {label}, nibbles swapped", rel_err=bad,
                                           ok=bad > 0.1))
                        must_fail_done = True
                except Exception as ex:  # noqa: BLE001 - one failing variant must not hide the others
                    print(f"  {name} M={M} {label} FAILED: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                    checks.append(dict(check=f"{name} M={M} {label}", rel_err=float("inf"), ok=False,
                                       error=f"{type(ex).__name__}: {str(ex)[:200]}"))
                    continue
                ok = e < TOL
                checks.append(dict(check=f"{name} M={M} {label}", rel_err=e, ok=ok))
                if not ok:
                    print(f"  {name} M={M} {label} WRONG: rel err {e:.2e}", flush=True)
                    continue
                try:
                    sec = time_graph(lambda i: fn(*ws[i % copies]), 2 * copies)
                except Exception as ex:  # noqa: BLE001
                    print(f"  {name} M={M} {label} timing FAILED: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                    continue
                # again after hundreds of graph replays: a race in the split reduction or an arrival counter left
                # non-zero would show here (no split is then last and y keeps torch.empty's garbage)
                e_after = rel_err(fn(*ws[0]), ref)
                if not e_after < TOL:
                    checks.append(dict(check=f"{name} M={M} {label} after timing", rel_err=e_after, ok=False))
                    print(f"  {name} M={M} {label} WRONG after timing: rel err {e_after:.2e}", flush=True)
                    continue
                e = max(e, e_after)
                nb = family.bytes(N, K, M)
                row = dict(op=family.op, shape=name, N=N, K=K, M=M, variant=label, us=sec * 1e6,
                           pct=100 * nb / sec / hbm, pct_d2d=100 * nb / sec / (d2d or hbm), bytes=nb, rel_err=e,
                           launches=family.launches(c), per_token=per_token,
                           config={k: v for k, v in c.items() if k in ("LOAD_MODE", "BLOCK_N", "SPLIT_K", "X_BUILD",
                                                                         "X_INLINE", "SPLIT_REDUCE", "ONE_DOT",
                                                                         "num_warps", "num_stages", "maxnreg")})
                fma = c.get("FMA") if family is Nvfp4 and not cfg else None
                if fma is not None:
                    row["config"] = dict(FMA=fma)
                out_rows.append(row)
                print(f"  {family.op[:5]} {name:15s} M={M} {label:26s} {row['us']:7.1f} us {row['pct']:4.0f}% read "
                      f"({row['pct_d2d']:3.0f}% D2D)  " + (f"FMA {fma}  " if fma is not None else
                                                         f"split {c['SPLIT_K']:2d}  ")
                      + f"launches {row['launches']}  err {e:.1e}", flush=True)
        del ws
        dump()
    return True


def winners(rows) -> dict:
    best = {}
    for r in rows:
        if r["variant"].startswith("x given"):
            continue                        # not a configuration: the x operands come from elsewhere
        k = (r["op"], r["shape"], r["M"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    return best


def summary(rows):
    """The table (default vs best per op, shape and M), the per-token sums and GEMV_CHOICES."""
    best = winners(rows)
    default = {(r["op"], r["shape"], r["M"]): r for r in rows if r["variant"] == "default"}
    per_token = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        print(f"\n== {op}, default vs best variant (us, % of the read ceiling) ==")
        print(f"  {'shape':15s} M  {'default':>14s}  {'best':>14s}  variant")
        sums = {"default": 0.0, "best": 0.0}
        for (o, shape, M), b in best.items():
            if o != op:
                continue
            d = default.get((op, shape, M))
            dt = f"{d['us']:6.1f} {d['pct']:3.0f}%" if d else "      -     "
            print(f"  {shape:15s} {M}  {dt:>14s}  {b['us']:6.1f} {b['pct']:3.0f}%  {b['variant']}")
            if M == 1 and d:
                sums["default"] += d["us"] * d["per_token"]
                sums["best"] += b["us"] * b["per_token"]
        what = "if all were NVFP4" if op == Nvfp4.op else "its FP8 modules"
        print(f"  M = 1, per decode token of the 88-layer Super ({what}): default {sums['default'] / 1e3:.2f} ms, "
              f"best {sums['best'] / 1e3:.2f} ms")
        per_token[op] = sums
    given = {(r["shape"], r["M"]): r for r in rows if r["variant"].startswith("x given")}
    saved = sum(n * (default[(Nvfp4.op, sh, 1)]["us"] - given[(sh, 1)]["us"]) for sh, n in SHARED_X.items()
                if (Nvfp4.op, sh, 1) in default and (sh, 1) in given)
    if given:
        print(f"  NVFP4, sharing x operands instead (k/v take q's, fc1 the shared up's): {saved:.0f} us/token")
    choices = {}
    for (op, shape, M), b in best.items():
        d = default.get((op, shape, M))
        if op != Nvfp4.op or b["variant"] == "default" or (d and b["us"] > MARGIN * d["us"]):
            continue
        m_pad = triton.next_power_of_2(M)
        base = resolved({}, M, b["N"], b["K"])
        diff = {k: v for k, v in b["config"].items() if base.get(k, FLAG_DEFAULTS.get(k)) != v}
        choices[(_arch(torch.device(DEV)), m_pad, b["N"], b["K"])] = diff
    print("\n== GEMV_CHOICES (NVFP4; paste into kernels/gemv_nvfp4.py once the table is read) ==")
    print("GEMV_CHOICES = {")
    for k, v in choices.items():
        print(f"    {k}: {v!r},")
    print("}")
    fp8 = [(b["shape"], b["M"], b["variant"], b["config"]) for (op, _, _), b in best.items()
           if op == Fp8.op and b["variant"] != "default"
           and b["us"] <= MARGIN * default.get((op, b["shape"], b["M"]), b)["us"]]
    if fp8:
        print("FP8 winners (fp8_gemv config keys; no FP8 choice table yet):", fp8)
    return per_token, choices


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemv_sweep.json"))
    ap.add_argument("--budget-s", type=float, default=140.0)
    ap.add_argument("--only", default="", help="comma-separated shape names")
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--counts", action="store_true", help="print the per-call counts and exit")
    ap.add_argument("--fp8", action="store_true", help="time the FP8 GEMV's variants (its own shapes) instead")
    a = ap.parse_args(argv)
    t0 = time.time()
    family = Fp8 if a.fp8 else Nvfp4
    shapes = (FP8_SHAPES if a.fp8 else SHAPES) if CUDA else SMOKE_SHAPES
    if a.only:
        shapes = [s for s in shapes if s[0] in a.only.split(",")]
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 132
    if a.counts:
        calls, compiles = plan(SHAPES, (1, 8), n_sm)
        print(f"  a full run: {calls} timed configurations, {compiles} distinct GEMV compilations")
        calls, compiles = plan(FP8_SHAPES, (1, 8), n_sm, Fp8)
        print(f"  --fp8: {calls} timed configurations, {compiles} distinct GEMV compilations")
        for r in counts(SHAPES, n_sm):
            print(f"  {r['shape']:15s} M={r['M']} {r['bytes'] / 1e6:6.2f} MB floor {r['floor_us']:5.1f} us  mode "
                  f"{r['mode']} BN{r['BLOCK_N']:<3d} programs {r['programs']:5d} ({r['programs_per_sm']:4.1f}/SM) "
                  f"split {r['split']:2d} tiles/program {r['tiles_per_program']:2d} launches {r['launches']} "
                  f"x-operand reads {r['x_operand_reads_MB']:5.1f} MB  x{r['per_token']}/token")
        return 0
    env = dict(gpu=torch.cuda.get_device_name(0) if CUDA else "none (CPU smoke run, TRITON_INTERPRET=1)",
               sms=n_sm if CUDA else 0, torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print("env", env, flush=True)
    read, d2d = ceiling_read(), ceiling_d2d()
    print(f"read {read / 1e9:.0f} GB/s, D2D {d2d / 1e9:.0f} GB/s", flush=True)
    rows, checks = [], []

    def dump(done=False, **extra):   # after every shape too: a run cut short keeps what it measured
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(env=env, read_GBps=read / 1e9, d2d_GBps=d2d / 1e9, rows=rows, checks=checks,
                           complete=done, **extra), f, indent=1, default=str)

    done = run(shapes, [int(m) for m in a.m.split(",")], a.budget_s, read, rows, checks, t0, dump, family, d2d)
    per_token, choices = summary(rows)
    bad = report_checks(checks)
    dump(done, per_token_ms={op: {k: v / 1e3 for k, v in d.items()} for op, d in per_token.items()},
         choices={str(k): v for k, v in choices.items()})
    print(f"wrote {a.out}; total {time.time() - t0:.0f} s")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
