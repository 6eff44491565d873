"""Dense NVFP4 / FP8 linears at Nemotron 3 Super shapes: % of measured HBM bandwidth on the bytes read."""
from __future__ import annotations

import torch
import triton

from bench.kernels.common import DEV, time_graph
from bench.kernels.gemv_nvfp4_modes import nvfp4_linear_mode
from kernels.gemv_nvfp4 import fp8_linear, fp8_linear_torch, gemv_config, nvfp4_linear, nvfp4_linear_torch
from kernels.testing import rel_err

# (name, N, K): Super's dense shapes at decode
SHAPES = [("mamba.in_proj", 18560, 4096), ("mamba.out_proj", 4096, 8192), ("attn.q/o", 4096, 4096),
          ("shared.up", 5376, 4096), ("shared.down", 4096, 5376), ("fc1_latent", 1024, 4096),
          ("fc2_latent", 4096, 1024), ("lm_head", 131072, 4096)]
# issue 19: the lookup / int16 decodes beside the old default (mode 3 at M=1, mode 4 above); label -> config
BASELINE = "old default (mode 3 / 4)"
DEFAULT = "default (gemv_config)"


def variants(M, full):
    """The variants timed at M rows: all candidates on the first shape (full), the likely winners elsewhere.
    LOST: a mode of bench/kernels/gemv_nvfp4_modes.py; otherwise a config for kernels' nvfp4_linear."""
    v = {BASELINE: dict(LOST=3 if M == 1 else 4), DEFAULT: {}}
    if M == 1:
        if full:
            v["mode 6 (prmt lookup, block-diag x)"] = dict(LOST=6)
            v["mode 8 BN128 w8"] = dict(LOAD_MODE=8, BLOCK_N=128, num_warps=8)
            v["mode 8 BN128 split1"] = dict(LOAD_MODE=8, BLOCK_N=128, SPLIT_K=1)
            v["mode 9 BN128"] = dict(LOAD_MODE=9, BLOCK_N=128)
        v["mode 8 BN64"] = dict(LOAD_MODE=8, BLOCK_N=64)
        v["mode 8 BN128"] = dict(LOAD_MODE=8, BLOCK_N=128)
        v["mode 8 BN64 x-inline"] = dict(LOAD_MODE=8, BLOCK_N=64, X_INLINE=True)
        v["mode 8 BN128 x-inline"] = dict(LOAD_MODE=8, BLOCK_N=128, X_INLINE=True)
    elif M <= 4:
        v["mode 8 BN128"] = dict(LOAD_MODE=8, BLOCK_N=128)
        v["mode 9 BN128"] = dict(LOAD_MODE=9, BLOCK_N=128)
    else:
        if full:
            v["mode 7 (prmt lookup, scales on tile)"] = dict(LOST=7)
            v["mode 9 BN64"] = dict(LOAD_MODE=9, BLOCK_N=64)
            v["mode 9 BN128 w8"] = dict(LOAD_MODE=9, BLOCK_N=128, num_warps=8)
        v["mode 9 BN128"] = dict(LOAD_MODE=9, BLOCK_N=128)
        v["mode 9 BN128 x-inline"] = dict(LOAD_MODE=9, BLOCK_N=128, X_INLINE=True)
    return v


def _rand_nvfp4(N, K, copies):
    """Random codes and sane e4m3 scales (2^-2 .. 2^2), `copies` independent sets to defeat the L2."""
    out = []
    for _ in range(copies):
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=DEV)
        s = torch.randint(0x28, 0x48, (N, K // 16), dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
        out.append((q, s, torch.tensor(1e-3, device=DEV)))
    return out


def _copies(nb):
    """Enough weight copies that the set rotated through is ~4x the 60 MB L2 (1 on the CPU smoke run)."""
    return 1 if DEV == "cpu" else min(64, max(2, (256 << 20) // nb + 1))


def _bytes(N, K, M):
    return N * K // 2 + N * K // 16 + M * K * 2 + M * N * 2


def _call(cfg, M, N, K, out_dtype=None):
    """fn(x, q, s, gs) for a variant (output in x's dtype unless out_dtype)."""
    c = _config(cfg, M, N, K)
    if "LOST" in c:
        return lambda x, q, s, gs: nvfp4_linear_mode(x, q, s, gs, c["LOST"], split_k=c["SPLIT_K"]), c
    if not cfg:
        return (lambda x, q, s, gs: nvfp4_linear(x, q, s, gs, out_dtype=out_dtype),
                dict(gemv_config(M, N, K, torch.device(DEV))))
    return lambda x, q, s, gs: nvfp4_linear(x, q, s, gs, out_dtype=out_dtype, config=c), c


def _config(cfg, M, N, K):
    """The heuristic's split-K for this block shape, unless the variant fixes it."""
    c = dict(cfg)
    if "SPLIT_K" not in c:
        bn, bk = c.get("BLOCK_N", 64), c.get("BLOCK_K", 256)
        n_blocks = triton.cdiv(N, bn)
        n_sm = gemv_config(M, N, K, torch.device(DEV))["n_sm"]
        c["SPLIT_K"] = 1 if n_blocks >= 2 * n_sm else max(1, min(triton.cdiv(2 * n_sm, n_blocks), K // (4 * bk)))
    return c


def run(ctx) -> list[dict]:
    hbm = ctx["ceil"]["d2d_GBps"] * 1e9
    shapes = ctx.get("gemv_shapes", SHAPES)
    rows, checks = [], ctx["checks"]
    big = shapes[0]
    # correctness of every variant at the big shape on the GPU (the inline PTX runs only here), fresh inputs
    for M in (1, 2, 4, 8):
        (q, s, gs), = _rand_nvfp4(big[1], big[2], 1)
        x = torch.randn(M, big[2], device=DEV).bfloat16()
        ref = nvfp4_linear_torch(x, q, s, gs, torch.float32)
        for label, cfg in variants(M, True).items():
            fn, _ = _call(cfg, M, big[1], big[2], torch.float32)
            e = rel_err(fn(x, q, s, gs), ref)
            checks.append(dict(check=f"nvfp4 {label} M={M} {big[1]}x{big[2]}", rel_err=e, ok=e < 1e-5))
    best: dict = {}
    for si, (name, N, K) in enumerate(shapes):
        copies = _copies(_bytes(N, K, 1))
        ws = _rand_nvfp4(N, K, copies)
        for M in ((1, 2, 4, 8) if si == 0 else (1, 8)):
            x = torch.randn(M, K, device=DEV).bfloat16()
            for label, cfg in variants(M, si == 0).items():
                fn, c = _call(cfg, M, N, K)
                try:
                    sec = time_graph(lambda i: fn(x, *ws[i % copies]), 2 * copies)
                except Exception as ex:  # noqa: BLE001 - one failing variant must not hide the others
                    print(f"  {name} M={M} {label} failed: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                    continue
                nb = _bytes(N, K, M)
                row = dict(op="nvfp4 gemv", case=f"{name} {N}x{K} M={M} {label} split={c['SPLIT_K']}",
                           us=sec * 1e6, bytes=nb, GBps=nb / sec / 1e9, pct=100 * nb / sec / hbm, shape=name, M=M,
                           variant=label)
                rows.append(row)
                print(f"   {row['case']}: {row['us']:.1f} us {row['pct']:.0f}%", flush=True)
                key = (name, M)
                if key not in best or row["us"] < best[key]["us"]:
                    best[key] = row
        del ws
    for (name, M), r in best.items():
        rows.append(dict(op="nvfp4 gemv BEST", case=f"{name} M={M}: {r['variant']}", us=r["us"], GBps=r["GBps"],
                         pct=r["pct"]))
    # FP8 per-tensor: the decode kernel (prepared x.T, direct e4m3 -> fp16) against the old tile GEMM
    for name, N, K in [sh for sh in shapes if sh[0] in ("mamba.in_proj", "mamba.out_proj", "shared.up")]:
        nb = N * K + 2 * K + 2 * N
        copies = _copies(nb)
        ws = [(torch.randint(-100, 100, (N, K), device=DEV, dtype=torch.int8).view(torch.uint8)
               .bitwise_and(0x77).view(torch.float8_e4m3fn), torch.tensor(1e-3, device=DEV)) for _ in range(copies)]
        for M in (1, 8):
            x = torch.randn(M, K, device=DEV).bfloat16()
            e = rel_err(fp8_linear(x, *ws[0], out_dtype=torch.float32), fp8_linear_torch(x, *ws[0], torch.float32))
            checks.append(dict(check=f"fp8 gemv M={M} {N}x{K}", rel_err=e, ok=e < 1e-5))
            for label, cfg in (("gemv BN64", None), ("gemv BN128 BK256", dict(BLOCK_N=128, BLOCK_K=256)),
                               ("old tile GEMM", dict(BLOCK_M=16))):
                if label == "old tile GEMM":
                    bn = 128
                    while bn > 16 and triton.cdiv(N, bn) < 2 * 132:
                        bn //= 2
                    cfg = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128)
                try:
                    sec = time_graph(lambda i: fp8_linear(x, *ws[i % copies], config=cfg), 2 * copies)
                except Exception as ex:  # noqa: BLE001
                    print(f"  fp8 {name} M={M} {label} failed: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                    continue
                rows.append(dict(op="fp8 gemv", case=f"{name} {N}x{K} M={M} {label}", us=sec * 1e6, bytes=nb,
                                 GBps=nb / sec / 1e9, pct=100 * nb / sec / hbm))
                print(f"   fp8 {name} M={M} {label}: {sec * 1e6:.1f} us {100 * nb / sec / hbm:.0f}%", flush=True)
        del ws
    # the bf16 lm_head (1.07 GB read every token) through cuBLAS, as the engine runs it (dense QuantizedWeight)
    name, N, K = shapes[-1]
    nb = N * K * 2
    copies = 1 if DEV == "cpu" else 2
    ws = [torch.randn(N, K, device=DEV).bfloat16() for _ in range(copies)]
    from kernels.gemv_bf16 import bf16_gemv
    for M in (1, 8):
        x = torch.randn(M, K, device=DEV).bfloat16()
        e = rel_err(bf16_gemv(x, ws[0]), x.float() @ ws[0].float().t())
        checks.append(dict(check=f"bf16 gemv (Triton) M={M} {N}x{K}", rel_err=e, ok=e < 1e-5))
        cands = [("F.linear (cuBLAS)", lambda i: torch.nn.functional.linear(x, ws[i % copies]))]
        for bn, bk, nw, st in ((128, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 3)):
            cands.append((f"Triton BN{bn} BK{bk} w{nw} st{st}",
                          lambda i, bn=bn, bk=bk, nw=nw, st=st: bf16_gemv(x, ws[i % copies], bn, bk, nw, st)))
        for label, fn in cands:
            try:
                sec = time_graph(fn, 2 * copies)
            except Exception as ex:  # noqa: BLE001
                print(f"  bf16 M={M} {label} failed: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                continue
            print(f"   bf16 lm_head M={M} {label}: {sec * 1e6:.1f} us {100 * nb / sec / hbm:.0f}%", flush=True)
            rows.append(dict(op="bf16 lm_head", case=f"{N}x{K} M={M} {label}", us=sec * 1e6, bytes=nb,
                             GBps=nb / sec / 1e9, pct=100 * nb / sec / hbm))
    del ws
    # prefill GEMM: a chunk of 512 tokens through in_proj (unchanged kernel; guards against regressions)
    (q, s, gs), = _rand_nvfp4(big[1], big[2], 1)
    Mp = ctx.get("prefill_rows", 512)
    x = torch.randn(Mp, big[2], device=DEV).bfloat16()
    e = rel_err(nvfp4_linear(x, q, s, gs, out_dtype=torch.float32), nvfp4_linear_torch(x, q, s, gs, torch.float32))
    checks.append(dict(check=f"nvfp4 gemm M={Mp}", rel_err=e, ok=e < 1e-4))
    sec = time_graph(lambda i: nvfp4_linear(x, q, s, gs), 4)
    rows.append(dict(op="nvfp4 gemm", case=f"{big[1]}x{big[2]} M={Mp} default", us=sec * 1e6,
                     TFLOPs=2 * Mp * big[1] * big[2] / sec / 1e12))
    return rows
