"""The prefill's dense NVFP4 / FP8 projections: the tile-decoding GEMM against dequantize + cuBLAS, beside the bf16
GEMM measured in the same run (issue 13; kernels/dense_prefill.py holds the winner).

    python -m bench.kernels.dense_prefill [--rows 16,64,128,512,2048,16000] [--fmt nvfp4,fp8] [--piece 512]
                                          [--slices 4] [--out F.json]

Super's dense shapes (N x K): in_proj 18,560 x 4,096, out_proj 4,096 x 8,192, shared up 5,376 x 4,096, shared down
4,096 x 5,376, latent fc1 1,024 x 4,096, fc2 4,096 x 1,024. At each row count M, a span of M rows runs as the
engine's layer runs it, in pieces of 512 rows (--piece; the server's 512 MiB budget takes 1,024 since session 17)
over one weight ("pieces"), and, where M > the piece, as one call of M rows ("one"). Candidates (each timed for the
whole span, decodes included):
  kernel      today's path: `_nvfp4_gemm_kernel` / `_fp8_gemm_kernel` (fp32 y, then a cast to bf16)
  rega        kernels/linear_rega.py (NVFP4): the codes decoded into wgmma's register operand (sm_90; the Triton
              twin elsewhere), per piece, no decoded copy
  once        kernels.dense_prefill: decoded once per span (`held`), each piece `addmm_` with the global scale as alpha
  per_piece   the same decode, once per piece (a transient weight: what a cache that cannot hold it would do)
  slicedS     decoded per piece in S row slices (--slices, 4 by default: the bound of a small budget, 1/S of the
              weight; MAX_SLICES S)
  f32_cast    decoded once, `torch.mm(out_dtype=float32)`, then y · g cast to bf16 (the fp32 buffer the brief avoids)
  cublas_bf16 a bf16 weight of the same shape, plain `x @ w.T` per piece: the ceiling, no decode at all
Every candidate is checked at full size against the fp32 twin (`nvfp4_linear_torch` / `fp8_linear_torch`) at 512
rows (and the largest M, one call, on in_proj), tolerance 4e-3 (the bf16 output's own rounding is ~1e-3); a
must-fail twin (the global scale left out of alpha) shows the check catches a wrong result.
A candidate that raises is recorded with its error and the run goes on. Without a GPU (a smoke run of this script,
Triton's interpreter): small shapes and rows, timed on the host.
Prints the table; writes JSON to --out (and to $OUT/ when set).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module defines its kernels

from bench.kernels.common import time_eager  # noqa: E402
from kernels import dense_prefill  # noqa: E402
from kernels.gemv_nvfp4 import fp8_linear, fp8_linear_torch, nvfp4_linear, nvfp4_linear_torch  # noqa: E402
from kernels.linear import QuantizedWeight, linear  # noqa: E402
from kernels.linear_rega import rega_linear  # noqa: E402
from kernels.nvfp4 import encode_fp8, encode_nvfp4  # noqa: E402
from kernels.testing import rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"

SHAPES = [("in_proj", 18560, 4096), ("out_proj", 4096, 8192), ("shared_up", 5376, 4096),
          ("shared_down", 4096, 5376), ("fc1", 1024, 4096), ("fc2", 4096, 1024)]
PIECE = 512
TOL = 4e-3
BIG = 1 << 40
SMOKE_SHAPES = [("in_proj", 200, 64), ("fc2", 48, 96)]    # no GPU: the interpreter's sizes


def gemm_ceiling(n=8192) -> float:
    n = n if CUDA else 128
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * n ** 3 / time_eager(lambda: a @ b, 10) / 1e12


def make_weight(fmt, N, K) -> QuantizedWeight:
    w = torch.randn(N, K, device=DEV) * (torch.rand(N, 1, device=DEV) + 0.1)
    if fmt == "nvfp4":
        return QuantizedWeight("nvfp4", *encode_nvfp4(w))
    return QuantizedWeight("fp8", *encode_fp8(w))


def pieces_of(M, one: bool):
    return [(0, M)] if one else [(a, min(M, a + PIECE)) for a in range(0, M, PIECE)]


def candidates(qw: QuantizedWeight, wb: torch.Tensor, slices=(4,), kernel_configs=()):
    """name -> fn(x, parts) -> y [M, N] bf16. kernel_configs: more tile-kernel configurations (NVFP4), each a
    candidate named by its keys ("kernel[BLOCK_M=128,...]")."""
    nb = dense_prefill.dequant_nbytes(qw)

    def kernel_with(config=None):
        def kernel(x, parts):
            y = torch.empty(x.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
            for a, b in parts:
                if qw.fmt == "nvfp4":
                    nvfp4_linear(x[a:b], qw.weight, qw.weight_scale, qw.weight_scale_2, config=config, out=y[a:b])
                else:
                    y[a:b] = fp8_linear(x[a:b], qw.weight, qw.weight_scale)
            return y
        return kernel
    kernel = kernel_with()

    def rega(x, parts):          # kernels/linear_rega.py: the codes decoded into the MMA's register operand
        y = torch.empty(x.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
        for a, b in parts:
            rega_linear(x[a:b], qw.weight, qw.weight_scale, qw.weight_scale_2, out=y[a:b])
        return y
    more = {f"kernel[{','.join(f'{k}={v}' for k, v in c.items())}]": kernel_with(c) for c in kernel_configs
            if qw.fmt == "nvfp4"}

    def through_linear(max_bytes, transient, broken=False, slices=1):
        def run(x, parts):
            dense_prefill.MAX_SLICES = slices
            y = torch.empty(x.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
            held = ([], max_bytes, x.shape[0], [qw]) if transient else ([qw], max_bytes, x.shape[0])
            with dense_prefill.held(*held) as cache:
                for a, b in parts:
                    if broken:      # must-fail twin: the global scale left out of alpha
                        y[a:b] = dense_prefill.linear_dequantized(x[a:b], cache.weight(qw, x.dtype), 1.0)
                    else:
                        y[a:b] = linear(x[a:b], qw)
            return y
        return run

    def f32_cast(x, parts):
        wd = dense_prefill.dequantize_unscaled(qw, torch.bfloat16)
        g = torch.tensor(qw.global_host(), device=x.device)
        y = torch.empty(x.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
        for a, b in parts:
            y[a:b] = (torch.mm(x[a:b], wd.t(), out_dtype=torch.float32) * g).to(x.dtype)
        return y

    def cublas(x, parts):
        y = torch.empty(x.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
        for a, b in parts:
            torch.mm(x[a:b], wb.t(), out=y[a:b])
        return y

    return {"kernel": kernel, **more, **({"rega": rega} if qw.fmt == "nvfp4" else {}),
            "once": through_linear(BIG, False), "per_piece": through_linear(BIG, True),
            **{f"sliced{n}": through_linear(nb // n + 1, False, slices=n) for n in slices},
            "f32_cast": f32_cast, "cublas_bf16": cublas, "broken_once": through_linear(BIG, False, broken=True)}


def main(argv=None):
    global PIECE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64,128,512,2048,16000")
    ap.add_argument("--fmt", default="nvfp4,fp8")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--piece", type=int, default=PIECE, help="rows of a piece (the engine's layer runs a span in them)")
    ap.add_argument("--slices", default="4", help="comma list: the sliced candidates' slice counts")
    ap.add_argument("--kernel-configs", default="",
                    help="';'-separated tile-kernel configurations, each KEY=INT,... (e.g. BLOCK_M=128,num_warps=8): "
                         "more NVFP4 candidates beside the default's")
    ap.add_argument("--out", default="dense_prefill.json")
    a = ap.parse_args(argv)
    PIECE = a.piece
    t0 = time.time()
    rows = [int(r) for r in a.rows.split(",")] if CUDA else [16, 130, 600]
    configs = [{k: int(v) for k, v in (kv.split("=") for kv in c.split(","))} for c in a.kernel_configs.split(";")
               if c]
    shapes = SHAPES if CUDA else SMOKE_SHAPES
    ceiling = gemm_ceiling()
    res = dict(device=torch.cuda.get_device_name() if CUDA else "cpu (smoke)", torch=torch.__version__,
               gemm_tflops=ceiling, piece=PIECE,
               checks=[], times=[])
    print(f"bf16 GEMM 8192^3: {ceiling:.1f} TFLOP/s", flush=True)
    want = set(a.shapes.split(","))
    for fmt in a.fmt.split(","):
        for name, N, K in [s for s in shapes if s[0] in want]:
            torch.manual_seed(zlib.crc32(f"{fmt} {name}".encode()))
            qw = make_weight(fmt, N, K)
            wb = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
            cands = candidates(qw, wb, [int(n) for n in a.slices.split(",") if n], configs)
            twin = (lambda x: nvfp4_linear_torch(x, qw.weight, qw.weight_scale, qw.weight_scale_2, torch.float32)) \
                if fmt == "nvfp4" else (lambda x: fp8_linear_torch(x, qw.weight, qw.weight_scale, torch.float32))
            # decode alone: bytes moved (packed in + bf16 out) per second
            td = time_eager(lambda: dense_prefill.dequantize_unscaled(qw, torch.bfloat16), 5)
            moved = qw.nbytes + dense_prefill.dequant_nbytes(qw)
            res["times"].append(dict(fmt=fmt, shape=name, N=N, K=K, cand="decode_only", us=td * 1e6,
                                     gbs=moved / td / 1e9))
            print(f"{fmt} {name} {N}x{K}: decode {td * 1e6:.1f} us ({moved / td / 1e9:.0f} GB/s)", flush=True)
            for m_chk, one in [(PIECE, False)] + ([(max(rows), True)] if name == "in_proj" else []):
                x = torch.randn(m_chk, K, device=DEV, dtype=torch.bfloat16)
                ref = twin(x)
                for c, fn in cands.items():
                    if c == "cublas_bf16":
                        continue
                    try:
                        e = rel_err(fn(x, pieces_of(m_chk, one)), ref)
                    except Exception as ex:   # recorded, the others still run
                        res["checks"].append(dict(fmt=fmt, shape=name, M=m_chk, cand=c, error=repr(ex), ok=False))
                        print(f"  check {c} M={m_chk}: ERROR {ex!r}"[:300], flush=True)
                        continue
                    ok = (e <= TOL) != c.startswith("broken")
                    res["checks"].append(dict(fmt=fmt, shape=name, M=m_chk, cand=c, rel_err=e, ok=ok))
                    print(f"  check {c} M={m_chk}: rel err {e:.2e} {'ok' if ok else 'FAILED'}", flush=True)
                del x, ref
            for M in rows:
                x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
                for one in ([False, True] if M > PIECE else [False]):
                    parts = pieces_of(M, one)
                    line = []
                    for c, fn in cands.items():
                        if c.startswith("broken") or any(k.get("error") for k in res["checks"]
                                                         if k["cand"] == c and k["shape"] == name and k["fmt"] == fmt):
                            continue
                        t = time_eager(lambda: fn(x, parts), 5)
                        tf = 2 * M * N * K / t / 1e12
                        res["times"].append(dict(fmt=fmt, shape=name, N=N, K=K, M=M, mode="one" if one else "pieces",
                                                 cand=c, us=t * 1e6, tflops=tf, frac=tf / ceiling))
                        line.append(f"{c} {t * 1e6:.0f}us {tf:.0f}T")
                    print(f"  M={M} {'one' if one else 'pieces'}: " + " | ".join(line), flush=True)
                del x
            del qw, wb, cands
            if CUDA:
                torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t0
    text = json.dumps(res, indent=1)
    with open(a.out, "w") as f:
        f.write(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], os.path.basename(a.out)), "w") as f:
            f.write(text)
    bad = [c for c in res["checks"] if not c["ok"]]
    print(f"{len(res['checks']) - len(bad)}/{len(res['checks'])} checks ok; {res['wall_s']:.0f} s")
    _table(res)


def _table(res):
    """Markdown: TFLOP/s (fraction of the 8192^3 GEMM) per shape, M and mode, each candidate."""
    by = {}
    for t in res["times"]:
        if "M" in t:
            by.setdefault((t["fmt"], t["shape"], t["M"], t["mode"]), {})[t["cand"]] = t
    cands = list(dict.fromkeys(t["cand"] for t in res["times"] if "M" in t))     # in the order they ran
    print("| fmt | shape | M | mode | " + " | ".join(cands) + " |")
    print("|" + " --- |" * (4 + len(cands)))
    for (fmt, shape, M, mode), d in by.items():
        cells = [f"{d[c]['tflops']:.0f} ({100 * d[c]['frac']:.0f} %)" if c in d else "-" for c in cands]
        print(f"| {fmt} | {shape} | {M} | {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
