"""The MoE router at Super's shape (E = 512 experts, hidden 4,096, top-22, one group; the router reads the hidden
row, not the 1,024-wide latent): today's plain-PyTorch router against the fused two-launch kernel (kernels/router.py)
at decode (M = 1, the layer's own router and the next layer's guess), and the prefill router's GEMM, fp32 against
bf16 → fp32 on the tensor cores, at T = 512 and 16,000. Per case: µs (CUDA graph of 20 calls, median of 7), device
launches per call (torch.profiler), and whether the routing agrees (rows whose expert sets differ, and how many of
those are near ties, a k-th vs (k+1)-th gap below 1e-5, where the summation order decides).

    python -m bench.kernels.router [--out router.json]

The gates rotate over 12 layers' worth of weights (96 MB bf16, 192 MB fp32: more than the H200's 50 MB L2), as in a
decode token, where gigabytes of other weights pass between two routers.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.kernels.common import DEV, time_graph
from kernels import router

E, H, K, SCALING = 512, 4096, 22, 5.0
SETS = 12


def launches(fn) -> int:
    """Device kernels and copies of one call of fn (eager), from the profiler."""
    if DEV != "cuda":
        return -1
    fn()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def near_ties(logits32, bias, k, tol=1e-5):
    c = torch.sigmoid(logits32) + bias
    top = c.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) < tol


def differing(a, b):
    return ~(a.sort(-1).values == b.sort(-1).values).all(-1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="router.json")
    ap.add_argument("--prefill", default="512,16000")
    ap.add_argument("--rows", type=int, default=256, help="single rows compared, fused against the twin")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    g16 = [(torch.randn(E, H, device=DEV) / H ** 0.5).to(torch.bfloat16) for _ in range(SETS + 1)]
    g32 = [g.float() for g in g16]
    bias = [torch.randn(E, device=DEV) * 0.05 for _ in range(SETS + 1)]
    h1 = [(torch.randn(1, H, device=DEV) * 0.5).to(torch.bfloat16) for _ in range(SETS)]
    cfg = (K, 1, 1, True, SCALING)
    res = dict(E=E, H=H, k=K, decode={}, prefill={})

    def today(i):  # the layer's router and the guess, as nemotron.moe before the fused kernel (fp32 gate)
        j = i % SETS
        router.route_torch(h1[j], g32[j], bias[j], *cfg)
        router.route_torch(h1[j], g32[j + 1], bias[j + 1], *cfg)

    def fused(gates, n):
        def f(i):
            j = i % SETS
            router.route_rows(h1[j], gates[j:j + n], bias[j:j + n], *cfg)
        return f

    cases = {"today_fp32_own+guess": today,
             "fused_bf16_own+guess": fused(g16, 2),
             "fused_bf16_own": fused(g16, 1),
             "fused_fp32_own+guess": fused(g32, 2)}
    print(f"== decode router, M = 1, E {E}, H {H}, top-{K}")
    print("case | µs / call | launches / call")
    for name, fn in cases.items():
        us = time_graph(fn) * 1e6
        n = launches(lambda: fn(0))
        res["decode"][name] = dict(us=round(us, 2), launches=n)
        print(f"{name} | {us:.2f} | {n}")
    # agreement of the fused router with the twin on many single rows (bf16 gate, as Super stores it)
    rows = (torch.randn(a.rows, H, device=DEV) * 0.5).to(torch.bfloat16)
    ref_e, ref_w = router.route_torch(rows, g16[0], bias[0], *cfg)
    got_e = torch.empty_like(ref_e)
    got_w = torch.empty_like(ref_w)
    for m in range(rows.shape[0]):
        e, w = router.route_rows(rows[m:m + 1], [g16[0]], [bias[0]], *cfg)
        got_e[m], got_w[m] = e[0, 0], w[0, 0]
    diff = differing(got_e, ref_e)
    near = near_ties(rows.float() @ g32[0].T, bias[0], K)
    agree = dict(rows=rows.shape[0], sets_differ=int(diff.sum()), of_which_near_ties=int((diff & near).sum()),
                 same_order=int((got_e == ref_e).all(-1).sum()),
                 max_weight_diff=float((got_w - ref_w).abs().max()))
    res["decode"]["fused_vs_twin"] = agree
    print(f"fused vs twin on {agree['rows']} rows: expert sets differ on {agree['sets_differ']} "
          f"({agree['of_which_near_ties']} near ties), same order on {agree['same_order']}, "
          f"max |Δ weight| {agree['max_weight_diff']:.2e}")

    print("== prefill router GEMM (and the whole router), fp32 vs bf16 -> fp32")
    print("T | fp32 GEMM µs | bf16->fp32 GEMM µs | router fp32 µs | router bf16 µs | rows differ (near ties)")
    for T in [int(t) for t in a.prefill.split(",") if t]:
        hs = [(torch.randn(T, H, device=DEV) * 0.5).to(torch.bfloat16) for _ in range(2)]
        w16, w32, b = g16[0], g32[0], bias[0]
        if DEV == "cuda":
            def mm16(x):
                return torch.mm(x, w16.T, out_dtype=torch.float32)
        else:
            def mm16(x):
                return x.float() @ w32.T
        t32 = time_graph(lambda i: hs[i % 2].float() @ w32.T, n_inner=4) * 1e6
        t16 = time_graph(lambda i: mm16(hs[i % 2]), n_inner=4) * 1e6
        r32 = time_graph(lambda i: router.select_torch(hs[i % 2].float() @ w32.T, b, *cfg), n_inner=4) * 1e6
        r16 = time_graph(lambda i: router.select_torch(mm16(hs[i % 2]), b, *cfg), n_inner=4) * 1e6
        l32, l16 = hs[0].float() @ w32.T, mm16(hs[0])
        e32, e16 = router.select_torch(l32, b, *cfg)[0], router.select_torch(l16, b, *cfg)[0]
        diff = differing(e32, e16)
        near = near_ties(l32, b, K)
        res["prefill"][T] = dict(gemm_fp32_us=round(t32, 1), gemm_bf16_us=round(t16, 1), router_fp32_us=round(r32, 1),
                                 router_bf16_us=round(r16, 1), rows_differ=int(diff.sum()),
                                 of_which_near_ties=int((diff & near).sum()),
                                 max_logit_diff=float((l32 - l16).abs().max()))
        print(f"{T} | {t32:.1f} | {t16:.1f} | {r32:.1f} | {r16:.1f} | {int(diff.sum())} ({int((diff & near).sum())})")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
