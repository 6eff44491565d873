"""The grouped expert prefill's variants (bench/kernels/expert_prefill_variants.py) checked and timed side by side,
beside the bf16 GEMM ceiling measured in the same run (issue 13, part 2: >= 50 % of it at >= 256 tokens per expert).

    python -m bench.kernels.expert_prefill_sweep [--tokens 16,64,256,1024] [--experts 32] [--out sweep.json]
        [--only fused/base,dequant/c16] [--engine] [--budget-s 230]

GPU: Super geometry (ExpertGeometry 1024 x 2688), n experts per launch at T tokens each, weights in VRAM rotated
over 4 sets (1.6 GB of blocks at 32 experts: far beyond the 60 MB L2). CPU (a smoke run, Triton's interpreter): a
tiny geometry, two token counts, small tiles.

Before any timing every variant is checked on an odd case (L 48, I 80, 5 experts, one unrouted, 37 tokens x 2
experts) against the PyTorch twin (1e-3, the tests' tolerance), and the same check is shown to catch a broken twin
of it (each expert's last row dropped). At each T the variant is checked again on 3 experts of the real shape.
--engine also runs bench.prefill.kernel_bench: the engine's entry (kernels.expert_prefill.expert_prefill_grouped)
with weights in VRAM, zero-copy from pinned memory and staged by the copy engine, against the measured H2D.
Prints a table last; writes JSON to --out (and to $OUT/ when that is set).
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

from bench.kernels import expert_prefill_variants as V  # noqa: E402
from kernels.expert_block import SUPER, ExpertGeometry, pack_expert_block  # noqa: E402
from kernels.expert_prefill import GROUPED_CONFIG, expert_prefill_grouped_torch  # noqa: E402
from kernels.nvfp4 import encode_nvfp4  # noqa: E402
from kernels.testing import rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
TOL = 1e-3

# (name, variant, config); names are variant/what differs
P128 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4)
CANDIDATES = [     # in order of interest: a run that meets its time budget skips the tail
    ("fused/base", "fused", dict(GROUPED_CONFIG)),
    ("dequant/default", "dequant", {}),                      # kernels' DEQUANT_CONFIG, chunks by the scratch budget
    # session 39: a plain GEMM's pipeline (a block's wgmma in flight across the loop's end), with and without the
    # ring's proxy fence (ptxas: a MEMBAR.ALL.CTA each block)
    ("rega/gluon-d7", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=7, num_warps=8)),
    ("rega/gluon-d7nf", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=7, FENCE=0, num_warps=8)),
    ("rega/gluon-d7s4", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=4, DEPTH=7, num_warps=8)),
    # session 40: DEPTH 7's operands in two register sets (session 39's loop rewrote one in flight: wrong sums at
    # STAGES 3), the epilogue's stores coalesced (STORE 1, every config's default); "so": session 39's stores
    ("rega/gluon-d7so", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=7, STORE=0, num_warps=8)),
    # 256-token tiles: each weight decoded once for 256 rows (STORE 1 freed the registers: no spill in the up, 16-32
    # bytes in the down with Triton 3.6)
    ("rega/gluon-d1w", "rega_gluon", dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, DEPTH=1, num_warps=8)),
    ("rega/gluon-d6w", "rega_gluon", dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, DEPTH=6, num_warps=8)),
    ("rega/gluon-d5tw", "rega_gluon", dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, DEPTH=5, TMA=True, num_warps=8)),
    ("rega/gluon-d1wnf", "rega_gluon", dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, DEPTH=1, FENCE=0, num_warps=8)),
    ("rega/gluon-d1ws3", "rega_gluon", dict(BLOCK_M=256, BLOCK_N=128, STAGES=3, DEPTH=1, num_warps=8)),
    ("rega/gluon-d5tws3", "rega_gluon", dict(BLOCK_M=256, BLOCK_N=128, STAGES=3, DEPTH=5, TMA=True, num_warps=8)),
    # persistent (one CTA an SM over its share of the tiles, x's ring running on across them)
    ("rega/gluon-d5tp", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=5, TMA=True, PERSIST=True,
                                           num_warps=8)),
    ("rega/gluon-d5tpw", "rega_gluon", dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, DEPTH=5, TMA=True, PERSIST=True,
                                            num_warps=8)),
    ("rega/gluon-d6nf", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=6, FENCE=0, num_warps=8)),
    ("rega/gluon", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=3, num_warps=8)),    # session 37
    ("rega/gluon-d4", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=4, num_warps=8)),
    ("rega/gluon-d5", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=5, num_warps=8)),
    ("rega/gluon-d6", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=6, num_warps=8)),
    # session 38: x through TMA (DEPTH 5's order; one CTA barrier a block, none in the 4-warp CTA's ring refill)
    ("rega/gluon-t5", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=5, TMA=True, num_warps=8)),
    ("rega/gluon-t5-n64w4", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=64, STAGES=3, DEPTH=5, TMA=True, num_warps=4)),
    # session 38: mma.sync (sm_80+, the consumer cards' instruction), the warps 4 x 2 and 8 x 1 over the tile
    ("rega/v2", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, MMA=2, WARPS_N=2, num_warps=8)),
    ("rega/v2-wn1", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, MMA=2, WARPS_N=1, num_warps=8)),
    # session 40: 256-token tiles (128 KB of ring: sm_90 / sm_100 only; the RTX cards' SMs hold ~100 KB)
    ("rega/v2-wn1w", "rega_gluon", dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, MMA=2, WARPS_N=1, num_warps=8)),
    ("rega/gluon-d1", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=1, num_warps=8)),   # call 1's waits
    ("rega/gluon-n64w4-d4", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=64, STAGES=3, DEPTH=4, num_warps=4)),
    ("rega/gluon-n64w4", "rega_gluon", dict(BLOCK_M=128, BLOCK_N=64, STAGES=3, DEPTH=3, num_warps=4)),
    ("rega/gluon-m64-d4", "rega_gluon", dict(BLOCK_M=64, BLOCK_N=128, STAGES=4, DEPTH=4, num_warps=8)),
    ("rega/gluon-m64", "rega_gluon", dict(BLOCK_M=64, BLOCK_N=128, STAGES=4, DEPTH=3, num_warps=8)),
    ("rega/triton", "rega", dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)),
    ("dequant/ptr", "dequant", dict(P128)),                  # pointer loads at every T (the default below 256)
    ("dequant/tma", "dequant", dict(P128, TMA=True)),
    ("dequant/tma-n256", "dequant", dict(P128, BLOCK_N=256, num_stages=3, TMA=True)),
    ("dequant/tma-m256", "dequant", dict(P128, BLOCK_M=256, num_stages=3, TMA=True)),
    ("dequant/tma-w4", "dequant", dict(P128, num_warps=4, TMA=True)),
    ("dequant/tma-s3", "dequant", dict(P128, num_stages=3, TMA=True)),
    ("dequant/tma-k128", "dequant", dict(P128, BLOCK_K=128, num_stages=3, TMA=True)),
    ("dequant/c16", "dequant", dict(P128, CHUNK=16)),
    ("dequant/c8", "dequant", dict(P128, CHUNK=8)),
    ("dequant/tma-c8", "dequant", dict(P128, CHUNK=8, TMA=True)),
    ("dequant/m256", "dequant", dict(P128, BLOCK_M=256, num_stages=3)),
    ("dequant_pipe/c8", "dequant_pipe", dict(P128, CHUNK=8)),        # session 20: the decode beside the GEMMs
    ("dequant_pipe/c16", "dequant_pipe", dict(P128, CHUNK=16)),
    ("dequant_pipe/c4", "dequant_pipe", dict(P128, CHUNK=4)),
    ("dequant_pipe/tma-c8", "dequant_pipe", dict(P128, CHUNK=8, TMA=True)),
    ("quad/bk128", "quad", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)),
    ("fused/bk128", "fused", dict(GROUPED_CONFIG, BLOCK_K=128, num_stages=2)),
    ("grouped_mm", "grouped_mm", {}),
]
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)


def _small(cfg):
    """The interpreter's tiles: the candidate's structure (chunking) at sizes it can run in seconds."""
    if "STAGES" in cfg:      # Gluon (GPU only): not run on a CPU
        return None
    out = {k: v for k, v in cfg.items() if k in ("CHUNK", "TMA")}
    if "CHUNK" in out:
        out["CHUNK"] = 2
    return {**out, **SMALL}


# ------------------------------------------------------------------ data
def make_blocks(geom, n, device, scale_rows=False):
    """n random NVFP4 expert blocks [n, block_stride] (U8) and their global scales (up, down)."""
    out = torch.zeros(n, geom.block_stride, dtype=torch.uint8)
    ug, dg = [], []
    for e in range(n):
        u = torch.randn(geom.I, geom.L) * (torch.rand(geom.I, 1) if scale_rows else 1.0)
        d = torch.randn(geom.L, geom.I) * (torch.rand(geom.L, 1) if scale_rows else 1.0)
        uq, us, ugl = encode_nvfp4(u)
        dq, ds, dgl = encode_nvfp4(d)
        blk = pack_expert_block(geom, uq, us, dq, ds)
        out[e, :blk.numel()] = blk
        ug.append(float(ugl))
        dg.append(float(dgl))
    return out.to(device), torch.tensor(ug, device=device), torch.tensor(dg, device=device)


def routed(T, k, E, device, seed):
    """Expert-sorted rows of T tokens routed to k distinct experts each (expert E-1 never): (tok, w, segments)."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g) + 0.1
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E).tolist()
    starts = [sum(counts[:e]) for e in range(E)]
    return (order // k).to(device), weights.reshape(-1)[order].float().to(device), list(zip(starts, counts))


# ------------------------------------------------------------------ checks
def odd_case_check(fn, cfg, seed=0) -> dict:
    """The variant and its broken twin (each expert's last row dropped) against the PyTorch twin on odd shapes."""
    geom = ExpertGeometry(48, 80, "nvfp4")
    blocks, ug, dg = make_blocks(geom, 5, DEV, scale_rows=True)
    T = 37
    tok, w, segments = routed(T, 2, 5, DEV, seed)
    xs = torch.randn(T, geom.L, generator=torch.Generator().manual_seed(seed + 1)).bfloat16().to(DEV)[tok]
    addrs = [b.data_ptr() for b in blocks]
    ref = expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, geom.L, device=DEV))
    got = fn(xs, segments, addrs, geom, ug, dg, w, tok, torch.zeros(T, geom.L, device=DEV), config=cfg)
    broken = fn(xs, [(s, max(n - 1, 0)) for s, n in segments], addrs, geom, ug, dg, w, tok,
                torch.zeros(T, geom.L, device=DEV), config=cfg)
    e, eb = rel_err(got, ref), rel_err(broken, ref)
    return dict(odd_rel_err=e, odd_ok=e <= TOL, must_fail_rel_err=eb, must_fail_caught=not eb <= TOL)


# ------------------------------------------------------------------ timing
def median_seconds(fn, n, reps=5) -> float:
    if not CUDA:
        t = time.perf_counter()
        fn(0)
        return time.perf_counter() - t
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fn(i)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3 / n)
    ts.sort()
    return ts[len(ts) // 2]


def gemm_ceiling(n=8192) -> float:
    """bf16 n^3 on random data, TFLOP/s (the issue's ceiling); on the CPU a small fp32 one (smoke only)."""
    n = n if CUDA else 256
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16 if CUDA else torch.float32)
    b = torch.randn_like(a)
    return 2 * n ** 3 / median_seconds(lambda i: a @ b, 10) / 1e12


def d2d_ceiling(nbytes=1 << 30) -> float:
    """Device copy, bytes read + written per second (GB/s): the dequantized scratch's bound."""
    nbytes = nbytes if CUDA else 1 << 20
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    return 2 * nbytes / median_seconds(lambda i: b.copy_(a), 10) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,64,256,1024" if CUDA else "5,40")
    ap.add_argument("--experts", type=int, default=32 if CUDA else 4)
    ap.add_argument("--only", default="", help="comma list of candidate names (default: all)")
    ap.add_argument("--engine", action="store_true", help="also bench.prefill.kernel_bench (VRAM/zero-copy/staged)")
    ap.add_argument("--budget-s", type=float, default=230.0, help="skip candidates not started by then")
    ap.add_argument("--out", default="expert_prefill_sweep.json")
    a = ap.parse_args(argv)
    t_start = time.time()
    geom = SUPER if CUDA else ExpertGeometry(48, 80, "nvfp4")
    tokens = [int(t) for t in a.tokens.split(",")]
    E, n_sets = a.experts, 4 if CUDA else 1
    only = set(a.only.split(",")) - {""}
    cands = [c for c in CANDIDATES if not only or c[0] in only]
    res = dict(device=torch.cuda.get_device_name() if CUDA else "cpu (interpreter)", torch=torch.__version__,
               geometry=dict(L=geom.L, I=geom.I), experts=E, tokens_per_expert=tokens, rows=[], checks=[])
    import triton
    res["triton"] = triton.__version__
    res["gemm_tflops"] = gemm_ceiling()
    res["d2d_gbps"] = d2d_ceiling()
    print(f"bf16 GEMM {res['gemm_tflops']:.0f} TFLOP/s, D2D {res['d2d_gbps']:.0f} GB/s", flush=True)
    out_paths = [a.out] + ([os.path.join(os.environ["OUT"], os.path.basename(a.out))] if os.environ.get("OUT") else [])

    def save():
        for p in out_paths:
            with open(p, "w") as f:
                json.dump(res, f, indent=1, default=float)

    distinct = min(E, 8)
    blocks, ug8, dg8 = make_blocks(geom, distinct, "cpu")
    vram = blocks.to(DEV)[torch.arange(n_sets * E) % distinct].contiguous()    # n_sets x E blocks
    ug = ug8.to(DEV)[torch.arange(E) % distinct].contiguous()
    dg = dg8.to(DEV)[torch.arange(E) % distinct].contiguous()
    stride = geom.block_stride
    cases = {}
    for T in tokens:
        M = T * E
        gx = torch.Generator().manual_seed(T)
        xs = torch.randn(M, geom.L, generator=gx).bfloat16().to(DEV)
        ws = torch.rand(M, generator=gx).to(DEV)
        tok = (torch.randperm(M, generator=gx) % max(M // 4, 1)).to(DEV)
        acc = torch.zeros(max(M // 4, 1), geom.L, device=DEV)
        segs = [(e * T, T) for e in range(E)]
        ref3 = expert_prefill_grouped_torch(xs, segs[:3], [vram[e] for e in range(3)], geom, ug[:3], dg[:3], ws, tok,
                                            torch.zeros_like(acc))
        cases[T] = (xs, ws, tok, acc, segs, ref3)

    for name, variant, cfg in cands:
        if time.time() - t_start > a.budget_s:
            res["rows"].append(dict(name=name, skipped="time budget"))
            print(f"{name}: skipped (budget)", flush=True)
            continue
        fn = V.VARIANTS[variant]
        kcfg = cfg if CUDA else _small(cfg)
        if kcfg is None:
            res["rows"].append(dict(name=name, skipped="GPU only"))
            continue
        row = dict(name=name, variant=variant, config=kcfg)
        try:
            t0 = time.time()
            row.update(odd_case_check(fn, kcfg))
            row["compile_and_check_s"] = time.time() - t0
            for T in tokens:
                xs, ws, tok, acc, segs, ref3 = cases[T]
                part = torch.zeros_like(acc)
                fn(xs, segs[:3], [vram[e].data_ptr() for e in range(3)], geom, ug[:3], dg[:3], ws, tok, part,
                   config=kcfg)
                row[f"rel_err_T{T}"] = rel_err(part, ref3)

                def launch(i, xs=xs, ws=ws, tok=tok, acc=acc, segs=segs):
                    base = vram.data_ptr() + (i % n_sets) * E * stride
                    fn(xs, segs, [base + e * stride for e in range(E)], geom, ug, dg, ws, tok, acc, config=kcfg)
                sec = median_seconds(launch, 6 if T >= 256 else 12)
                row[f"us_T{T}"] = sec * 1e6
                row[f"tflops_T{T}"] = 2 * 2 * T * E * geom.L * geom.I / sec / 1e12
                row[f"of_gemm_T{T}"] = row[f"tflops_T{T}"] / res["gemm_tflops"]
        except Exception as e:   # a shape the compiler cannot fit (shared memory, registers) is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["rows"].append(row)
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        save()

    if CUDA and (not only or any(c[1] == "dequant" for c in cands)):    # where the dequantized path's time goes
        res["parts"] = parts(geom, vram, ug, dg, cases, E, n_sets, res["d2d_gbps"], res["gemm_tflops"])
        save()
    if a.engine and CUDA and time.time() - t_start < a.budget_s + 40:
        from bench.e2e_stream import copy_gbps
        from bench.prefill import kernel_bench
        h2d, _ = copy_gbps("cuda")
        res["h2d_gbps"] = h2d
        res["engine"] = kernel_bench(geom, "cuda", res["gemm_tflops"], h2d, tokens_per_expert=tuple(tokens),
                                     n_experts=E)
        save()
    res["wall_s"] = time.time() - t_start
    save()
    print_table(res)
    return res


def parts(geom, vram, ug, dg, cases, E, n_sets, d2d, gemm) -> list[dict]:
    """The dequantized path in pieces: the decode of E experts alone (against the copy ceiling, counting the fp4
    read and the 16-bit write), the two GEMMs over weights already decoded, and each GEMM alone (against the GEMM)."""
    import triton
    from kernels import expert_prefill as ep
    stride, L, I = geom.block_stride, geom.L, geom.I
    up_w = torch.empty((E, I, L), dtype=torch.bfloat16, device=DEV)
    down_w = torch.empty((E, L, I), dtype=torch.float16, device=DEV)
    sets = [torch.tensor([vram.data_ptr() + (s * E + e) * stride for e in range(E)], dtype=torch.int64, device=DEV)
            for s in range(n_sets)]
    out = []
    sec = median_seconds(lambda i: ep.dequantize(sets[i % n_sets], geom, up_w, down_w), 8)
    moved = E * (geom.block_bytes + 4 * L * I)
    out.append(dict(part="dequantize", experts=E, us=sec * 1e6, gbps=moved / sec / 1e9, of_d2d=moved / sec / 1e9 / d2d))
    print(json.dumps(out[-1], default=float), flush=True)
    ep.dequantize(sets[0], geom, up_w, down_w)
    cfg = dict(ep.DEQUANT_CONFIG)
    kcfg = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    live = list(range(E))
    for T, (xs, ws, tok, acc, segs, _) in cases.items():
        flat = ep.chunk_table(segs, live, [0] * E, cfg["BLOCK_M"], 0)
        tab = torch.tensor(flat, dtype=torch.int64, device=DEV)
        n_tiles = (len(flat) - 2 * E) // 3
        h = torch.empty(T * E * I, dtype=torch.float16, device=DEV)
        fl = 2 * T * E * L * I

        def both(i):
            ep.dense_gemms(xs, n_tiles, E, geom, up_w, down_w, tab, 0, T * E, ug, dg, ws, tok, acc, cfg, h)

        def up(i):
            ep._dense_up_kernel[(triton.cdiv(I, cfg["BLOCK_N"]), n_tiles)](
                xs, tab, ug, up_w, h, n_tiles, E, I, L, xs.stride(0), EVEN_K=True, UPCAST=False, **kcfg)

        def down(i, sem="relaxed"):
            ep._dense_down_kernel[(triton.cdiv(L, cfg["BLOCK_N"]), n_tiles)](
                h, tab, dg, ws, tok, down_w, acc, n_tiles, E, L, I, EVEN_K=True, UPCAST=False, SEM=sem, **kcfg)

        def down_acq_rel(i):     # Triton's default atomics (a GPU-scope barrier each): the epilogue before session 16
            down(i, "acq_rel")
        def both_tma(i):
            ep.dense_gemms(xs, n_tiles, E, geom, up_w, down_w, tab, 0, T * E, ug, dg, ws, tok, acc,
                           dict(cfg, TMA=True), h)
        for name, fn, flops in (("gemms", both, 2 * fl), ("up gemm", up, fl), ("down gemm", down, fl),
                                ("down gemm acq_rel", down_acq_rel, fl), ("gemms tma", both_tma, 2 * fl)):
            try:
                sec = median_seconds(fn, 6)
                out.append(dict(part=name, tokens_per_expert=T, us=sec * 1e6, tflops=flops / sec / 1e12,
                                of_gemm=flops / sec / 1e12 / gemm))
            except Exception as e:
                out.append(dict(part=name, tokens_per_expert=T, error=f"{type(e).__name__}: {e}"[:300]))
            print(json.dumps(out[-1], default=float), flush=True)
    return out


def print_table(res):
    tokens = res["tokens_per_expert"]
    print(f"\n{res['device']}, torch {res['torch']}, triton {res['triton']}; {res['experts']} experts per launch, "
          f"L {res['geometry']['L']} I {res['geometry']['I']}; bf16 GEMM {res['gemm_tflops']:.0f} TFLOP/s, "
          f"D2D {res['d2d_gbps']:.0f} GB/s")
    print(f"{'candidate':<18} {'odd/fail':<9} " + " ".join(f"{'T=' + str(t):>16}" for t in tokens) + "  max rel err")
    for r in res["rows"]:
        if "skipped" in r or "error" in r:
            print(f"{r['name']:<18} {r.get('skipped') or r['error'][:100]}")
            continue
        flags = ("ok" if r["odd_ok"] else "BAD") + "/" + ("ok" if r["must_fail_caught"] else "BAD")
        err = max(r[f"rel_err_T{t}"] for t in tokens)
        if not err <= TOL:          # NaN too: a wrong kernel's speed is no figure (session 40: DEPTH 7 printed one)
            cells = f"{'WRONG at the timed shapes: no timing counts':<{17 * len(tokens) - 1}}"
        else:
            cells = " ".join(f"{r[f'tflops_T{t}']:7.1f} ({100 * r[f'of_gemm_T{t}']:4.1f}%)" for t in tokens)
        print(f"{r['name']:<18} {flags:<9} {cells}  {err:.2e}")
    for p in res.get("parts", []):
        print("  " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in p.items()))
    for r in res.get("engine", []):
        print(f"  engine T/expert {r['tokens_per_expert']:>5}: vram {r['vram_tflops']:.1f} TFLOP/s "
              f"({100 * r['vram_fraction_of_gemm']:.1f}%), zero-copy {r['zero_copy_weight_gbps']:.1f} GB/s, "
              f"staged {r['staged_weight_gbps']:.1f} GB/s ({100 * r['staged_fraction_of_h2d']:.0f}% of H2D "
              f"{res['h2d_gbps']:.1f})")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
