"""The dequantized expert prefill with its GEMMs in Triton (today's default) against torch._grouped_mm (CUTLASS's
grouped GEMM on sm90; MOESTREAM_EXPERT_GEMM=grouped_mm, and grouped_mm_down: the Triton up, the down by
_grouped_mm), beside cuBLAS's bf16 GEMM on the same FLOPs (the issue-13 ceiling), in one process.

    python -m bench.kernels.expert_prefill_gmm [--experts 32,128,512] [--tokens 16,64,256,1024] [--budget-s 110]
        [--out expert_prefill_gmm.json]

GPU: Super geometry (L 1,024, I 2,688), E experts of T rows each, blocks in VRAM (8 distinct random experts repeated
at E addresses), tokens top-22 (E·T / 22 accumulator rows). Per (E, T), the whole launch (`expert_prefill_grouped`,
path "dequant": per chunk of 32 experts the decode, the GEMMs and their epilogues) for each GEMM choice; then, on one
chunk of min(E, 32) experts already decoded, the GEMMs alone (Triton's two launches with their epilogues; the two
_grouped_mm calls bare, and with the ReLU² and scatter kernels); and cuBLAS on [E·T, L] x [L, I] and [E·T, I] x [I, L]
(the same FLOPs, no grouping). Before timing, each choice is checked on 3 experts of the real shape against the twin:
the fp32 twin at 1e-3 (triton), the twin rounded where the path rounds at 1e-3 and the fp32 twin at 8e-3 (grouped_mm
and grouped_mm_down, bf16 h and y); and a must-fail twin (two experts' blocks swapped) is shown to be caught.
CPU: a smoke run on the interpreter (tiny geometry). Prints a table last; writes JSON to --out (and $OUT/).
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

from bench.kernels.expert_prefill_sweep import make_blocks, median_seconds  # noqa: E402
from kernels import expert_prefill as ep  # noqa: E402
from kernels.expert_block import SUPER, ExpertGeometry  # noqa: E402
from kernels.testing import rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
GEMMS = ("triton", "grouped_mm", "grouped_mm_down")
TOL, TOL_BF16 = 1e-3, 8e-3       # tests/kernels/test_expert_prefill_gmm.py's
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
TOP_K = 22


def check(geom, vram, ug, dg, xs, ws, tok, T, gemm, cfg) -> dict:
    """The launch on 3 experts of T rows against its twins, and its must-fail twin (experts 0 and 2 swapped)."""
    segs = [(e * T, T) for e in range(3)]
    blocks = [vram[e] for e in range(3)]
    acc = torch.zeros(3 * T, geom.L, device=DEV)
    x, w, t = xs[:3 * T], ws[:3 * T], tok[:3 * T] % (3 * T)
    fp32 = ep.expert_prefill_grouped_torch(x, segs, blocks, geom, ug[:3], dg[:3], w, t, acc.clone())
    run = lambda order: ep.expert_prefill_grouped(x, segs, [blocks[i].data_ptr() for i in order], geom, ug[:3], dg[:3],
                                                  w, t, acc.clone(), config=dict(cfg, GEMM=gemm), path="dequant")
    got, bad = run([0, 1, 2]), run([2, 1, 0])
    out = dict(fp32_rel_err=rel_err(got, fp32), must_fail_rel_err=rel_err(bad, fp32))
    if gemm == "triton":
        out["ok"] = out["fp32_rel_err"] <= TOL and not out["must_fail_rel_err"] <= TOL
    else:
        bf16 = ep.expert_prefill_grouped_torch(x, segs, blocks, geom, ug[:3], dg[:3], w, t, acc.clone(), bf16=gemm)
        out["bf16_twin_rel_err"] = rel_err(got, bf16)
        out["ok"] = (out["bf16_twin_rel_err"] <= TOL and out["fp32_rel_err"] <= TOL_BF16
                     and not rel_err(bad, bf16) <= TOL)
    return out


def gemms_alone(geom, vram, ug, dg, xs, ws, tok, acc, E, T, cfg) -> list[dict]:
    """One chunk of min(E, 32) experts, weights decoded once: the Triton GEMMs (with their epilogues), the two
    _grouped_mm calls bare, and with the ReLU² and scatter kernels."""
    L, I, C = geom.L, geom.I, min(E, 32)
    rows = C * T
    fl = 2 * 2 * rows * L * I
    addrs = torch.tensor([vram[e].data_ptr() for e in range(C)], dtype=torch.int64, device=DEV)
    up16, down16 = (torch.empty((C, I, L), dtype=torch.bfloat16, device=DEV),
                    torch.empty((C, L, I), dtype=torch.float16, device=DEV))
    up_b, down_b = torch.empty_like(up16), torch.empty((C, L, I), dtype=torch.bfloat16, device=DEV)
    ep.dequantize(addrs, geom, up16, down16)
    ep.dequantize(addrs, geom, up_b, down_b, down_bf16=True)
    segs = [(e * T, T) for e in range(C)]
    dcfg = ep.dequant_config(segs) if CUDA else dict(ep.DEQUANT_CONFIG, **SMALL)
    flat = ep.chunk_table(segs, list(range(C)), [0] * C, dcfg["BLOCK_M"], 0)
    tab = torch.tensor(flat, dtype=torch.int64, device=DEV)
    n_tiles = (len(flat) - 2 * C) // 3
    offs = torch.tensor(ep.gmm_group_ends(segs, list(range(C)), 0, rows), dtype=torch.int32, device=DEV)
    h16 = torch.empty(rows * I, dtype=torch.float16, device=DEV)
    x, w, t = xs[:rows], ws[:rows], tok[:rows]
    bm, bn = dcfg["BLOCK_M"], ep.GMM_EPI_BLOCK_N if CUDA else 32

    def triton_gemms(i):
        ep.dense_gemms(x, n_tiles, C, geom, up16, down16, tab, 0, rows, ug, dg, w, t, acc, dcfg, h16)

    def gmm_bare(i):
        h = torch._grouped_mm(x, up_b.transpose(1, 2), offs=offs)
        torch._grouped_mm(h, down_b.transpose(1, 2), offs=offs)

    def gmm_epilogues(i):
        h = torch._grouped_mm(x, up_b.transpose(1, 2), offs=offs)
        ep._gmm_relu2_kernel[(triton.cdiv(I, bn), n_tiles)](h, tab, ug, n_tiles, C, I, h.stride(0),
                                                            EMULATE=not CUDA, BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
        y = torch._grouped_mm(h, down_b.transpose(1, 2), offs=offs)
        ep._gmm_scatter_kernel[(triton.cdiv(L, bn), n_tiles)](y, tab, dg, w, t, acc, n_tiles, C, L, y.stride(0),
                                                              BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    out = []
    for name, fn in (("gemms triton", triton_gemms), ("gemms grouped_mm bare", gmm_bare),
                     ("gemms grouped_mm + epilogues", gmm_epilogues)):
        try:
            sec = median_seconds(fn, 4 if rows >= 1 << 14 else 10)
            out.append(dict(part=name, experts=C, tokens_per_expert=T, us=sec * 1e6, tflops=fl / sec / 1e12))
        except Exception as e:      # noqa: BLE001 — a result too
            out.append(dict(part=name, experts=C, tokens_per_expert=T, error=f"{type(e).__name__}: {e}"[:300]))
    return out


def cublas(geom, M) -> float:
    """Seconds of cuBLAS's bf16 GEMMs on the launch's FLOPs without the grouping: [M, L] x [L, I], [M, I] x [I, L]."""
    dt = torch.bfloat16 if CUDA else torch.float32
    a = torch.randn(M, geom.L, device=DEV, dtype=dt)
    wu = torch.randn(geom.I, geom.L, device=DEV, dtype=dt)
    wd = torch.randn(geom.L, geom.I, device=DEV, dtype=dt)
    h = torch.empty(M, geom.I, device=DEV, dtype=dt)
    return median_seconds(lambda i: (torch.mm(a, wu.t(), out=h), torch.mm(h, wd.t())), 6)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="32,128,512" if CUDA else "3")
    ap.add_argument("--tokens", default="16,64,256,1024" if CUDA else "5,9")
    ap.add_argument("--gemms", default=",".join(GEMMS))
    ap.add_argument("--budget-s", type=float, default=110.0, help="start no case after this many seconds")
    ap.add_argument("--out", default="expert_prefill_gmm.json")
    a = ap.parse_args(argv)
    t_start = time.time()
    geom = SUPER if CUDA else ExpertGeometry(48, 80, "nvfp4")
    experts = [int(v) for v in a.experts.split(",")]
    tokens = [int(v) for v in a.tokens.split(",")]
    gemms = a.gemms.split(",")
    res = dict(device=torch.cuda.get_device_name() if CUDA else "cpu (interpreter)", torch=torch.__version__,
               triton=triton.__version__, geometry=dict(L=geom.L, I=geom.I), experts=experts,
               tokens_per_expert=tokens, gemms=gemms, checks=[], rows=[], parts=[])
    out_paths = [a.out] + ([os.path.join(os.environ["OUT"], os.path.basename(a.out))] if os.environ.get("OUT") else [])

    def save():
        for p in out_paths:
            with open(p, "w") as f:
                json.dump(res, f, indent=1, default=float)

    distinct = min(max(experts), 8)
    blocks, ug8, dg8 = make_blocks(geom, distinct, "cpu")
    E_max = max(experts)
    vram = blocks.to(DEV)[torch.arange(E_max) % distinct].contiguous()
    ug = ug8.to(DEV)[torch.arange(E_max) % distinct].contiguous()
    dg = dg8.to(DEV)[torch.arange(E_max) % distinct].contiguous()
    cfg = {} if CUDA else dict(SMALL)
    for T in tokens:      # the twin checks, once per T (3 experts of the real shape)
        g = torch.Generator().manual_seed(T)
        xs = torch.randn(3 * T, geom.L, generator=g).bfloat16().to(DEV)
        ws = torch.rand(3 * T, generator=g).to(DEV)
        tok = torch.randperm(3 * T, generator=g).to(DEV)
        for gemm in gemms:
            c = dict(gemm=gemm, tokens_per_expert=T, **check(geom, vram, ug, dg, xs, ws, tok, T, gemm, cfg))
            res["checks"].append(c)
            print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.items()}), flush=True)
    save()

    for E in experts:
        for T in tokens:
            if time.time() - t_start > a.budget_s:
                res["rows"].append(dict(experts=E, tokens_per_expert=T, skipped="time budget"))
                print(f"E={E} T={T}: skipped (budget)", flush=True)
                continue
            M = E * T
            g = torch.Generator().manual_seed(E * 10007 + T)
            xs = torch.randn(M, geom.L, generator=g).bfloat16().to(DEV)
            ws = torch.rand(M, generator=g).to(DEV)
            n_tok = max(M // TOP_K, 1)
            tok = (torch.randperm(M, generator=g) % n_tok).to(DEV)
            acc = torch.zeros(n_tok, geom.L, device=DEV)
            segs = [(e * T, T) for e in range(E)]
            addrs = [vram[e].data_ptr() for e in range(E)]
            fl = 2 * 2 * M * geom.L * geom.I
            row = dict(experts=E, tokens_per_expert=T, gflop=fl / 1e9)
            sec = cublas(geom, M)
            row.update(cublas_us=sec * 1e6, cublas_tflops=fl / sec / 1e12)
            for gemm in gemms:
                def launch(i, gemm=gemm):
                    ep.expert_prefill_grouped(xs, segs, addrs, geom, ug[:E], dg[:E], ws, tok, acc,
                                              config=dict(cfg, GEMM=gemm), path="dequant")
                try:
                    sec = median_seconds(launch, 3 if M >= 1 << 15 else 8)
                    row[f"{gemm}_us"] = sec * 1e6
                    row[f"{gemm}_tflops"] = fl / sec / 1e12
                    row[f"{gemm}_of_cublas"] = row[f"{gemm}_tflops"] / row["cublas_tflops"]
                except Exception as e:      # noqa: BLE001
                    row[f"{gemm}_error"] = f"{type(e).__name__}: {e}"[:300]
            res["rows"].append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            if E == experts[0] and "grouped_mm" in gemms:
                parts = gemms_alone(geom, vram, ug, dg, xs, ws, tok, acc, E, T, cfg)
                for p in parts:
                    p["of_cublas"] = p.get("tflops", 0.0) / row["cublas_tflops"]
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in p.items()}),
                          flush=True)
                res["parts"] += parts
            save()
            del xs, ws, tok, acc
    res["wall_s"] = time.time() - t_start
    save()
    print_table(res)
    return all(c["ok"] for c in res["checks"])


def print_table(res):
    print(f"\n{res['device']}, torch {res['torch']}, triton {res['triton']}; L {res['geometry']['L']} "
          f"I {res['geometry']['I']}; whole launch (decode + GEMMs + epilogues) per GEMM choice, cuBLAS bf16 on the "
          f"same FLOPs; {res.get('wall_s', 0):.0f} s")
    bad = [c for c in res["checks"] if not c["ok"]]
    print("checks: " + ("all ok" if not bad else "FAILED " + ", ".join(f"{c['gemm']} T={c['tokens_per_expert']}"
                                                                        for c in bad)) + "; max rel err vs fp32 twin "
          + ", ".join(f"{g} {max(c['fp32_rel_err'] for c in res['checks'] if c['gemm'] == g):.1e}"
                      for g in res["gemms"]))
    head = f"{'E':>4} {'T':>5} {'cuBLAS µs':>10} {'TF/s':>6} | " + " | ".join(f"{g + ' µs':>18} {'TF/s':>6} {'%cuBLAS':>7}"
                                                                          for g in res["gemms"])
    print(head)
    for r in res["rows"]:
        if "skipped" in r:
            print(f"{r['experts']:>4} {r['tokens_per_expert']:>5} skipped ({r['skipped']})")
            continue
        cells = []
        for g in res["gemms"]:
            if f"{g}_us" in r:
                cells.append(f"{r[f'{g}_us']:>18.1f} {r[f'{g}_tflops']:>6.1f} {100 * r[f'{g}_of_cublas']:>6.1f}%")
            else:
                cells.append(f"{'error':>33}")
        print(f"{r['experts']:>4} {r['tokens_per_expert']:>5} {r['cublas_us']:>10.1f} {r['cublas_tflops']:>6.1f} | "
              + " | ".join(cells))
    for p in res["parts"]:
        if "error" in p:
            print(f"  {p['part']:<30} E={p['experts']} T={p['tokens_per_expert']}: {p['error'][:120]}")
        else:
            print(f"  {p['part']:<30} E={p['experts']:>3} T={p['tokens_per_expert']:>5}: {p['us']:>9.1f} µs "
                  f"{p['tflops']:>6.1f} TFLOP/s ({100 * p['of_cublas']:.1f}% of cuBLAS)")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
