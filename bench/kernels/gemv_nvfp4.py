"""Dense NVFP4 / FP8 linears at Nemotron 3 Super shapes: % of measured HBM bandwidth on the bytes read."""
from __future__ import annotations

import torch
import triton

from bench.kernels.common import DEV, time_graph
from kernels.gemv_nvfp4 import fp8_linear, fp8_linear_torch, gemv_config, nvfp4_linear, nvfp4_linear_torch
from kernels.testing import rel_err

# (name, N, K): Mamba in_proj, out_proj, attention q/o, shared expert up/down, fc1 latent, an lm_head-sized one
SHAPES = [("mamba.in_proj", 18560, 4096), ("mamba.out_proj", 4096, 8192), ("attn.q/o", 4096, 4096),
          ("shared.up", 5376, 4096), ("shared.down", 4096, 5376), ("fc1_latent", 1024, 4096),
          ("lm_head-size", 131072, 4096)]
SWEEP = [  # (BLOCK_N, BLOCK_K mult, num_warps, num_stages, LOAD_MODE); experiment 2: (64, 1, 4, 3, 3) best
    (64, 1, 4, 3, 3), (64, 1, 4, 3, 4), (128, 1, 4, 3, 3), (32, 1, 4, 3, 3),
]  # the lost modes (0, 1, 2, 5): bench/kernels/gemv_nvfp4_modes.py


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


def _cfg(t):
    bn, km, w, st, lm = t
    return dict(BLOCK_N=bn, BLOCK_K_MULT=km, num_warps=w, num_stages=st, LOAD_MODE=lm)


def _resolve(cfg, M, N, K):
    base = gemv_config(M, N, K, torch.device(DEV))
    c = dict(cfg)
    km = c.pop("BLOCK_K_MULT", 1)
    mode = c.get("LOAD_MODE")
    c["BLOCK_K"] = (256 if mode == 4 else max(256 // base["M_PAD"], 32)) * km
    n_blocks = triton.cdiv(N, c["BLOCK_N"])
    split = 1
    n_sm = base.get("n_sm", 132)
    if n_blocks < n_sm:
        split = max(1, min(triton.cdiv(2 * n_sm, n_blocks), K // (4 * c["BLOCK_K"])))
    c["SPLIT_K"] = split
    return c


def run(ctx) -> list[dict]:
    hbm = ctx["ceil"]["d2d_GBps"] * 1e9
    shapes, sweep = ctx.get("gemv_shapes", SHAPES), ctx.get("gemv_sweep", SWEEP)
    big = ctx.get("big", (18560, 4096))
    rows, checks = [], []
    # correctness at real size first (twin in fp32 on the GPU)
    for M in (1, 4, 8, 64):
        (q, s, gs), = _rand_nvfp4(*big, 1)
        x = torch.randn(M, big[1], device=DEV).bfloat16()
        e = rel_err(nvfp4_linear(x, q, s, gs, out_dtype=torch.float32), nvfp4_linear_torch(x, q, s, gs, torch.float32))
        checks.append(dict(check=f"nvfp4_linear M={M} {big[0]}x{big[1]}", rel_err=e, ok=e < 1e-4))
    for mode in (3, 4):
        (q, s, gs), = _rand_nvfp4(*big, 1)
        x = torch.randn(1, big[1], device=DEV).bfloat16()
        e = rel_err(nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=dict(LOAD_MODE=mode, BLOCK_K=256)),
                    nvfp4_linear_torch(x, q, s, gs, torch.float32))
        checks.append(dict(check=f"nvfp4_linear M=1 mode {mode} {big[0]}x{big[1]}", rel_err=e, ok=e < 1e-5))
    w = torch.randn(big[1], 2 * big[1], device=DEV) * 0.02
    f8, sc = (w / (w.abs().max() / 448)).to(torch.float8_e4m3fn), (w.abs().max() / 448).float()
    for M in (1, 8, 64):
        x = torch.randn(M, 2 * big[1], device=DEV).bfloat16()
        e = rel_err(fp8_linear(x, f8, sc, out_dtype=torch.float32), fp8_linear_torch(x, f8, sc, torch.float32))
        checks.append(dict(check=f"fp8_linear M={M} {big[1]}x{2 * big[1]}", rel_err=e, ok=e < 1e-4))

    # sweep block shapes on the largest common shape, M=1
    name, N, K = shapes[0]
    copies = _copies(_bytes(N, K, 1))
    ws = _rand_nvfp4(N, K, copies)
    x = torch.randn(1, K, device=DEV).bfloat16()
    best = None
    for t in sweep:
        c = _resolve(_cfg(t), 1, N, K)
        try:
            sec = time_graph(lambda i: nvfp4_linear(x, *ws[i % copies], config=c), 2 * copies)
        except Exception as ex:  # noqa: BLE001
            print(f"  config {t} failed: {type(ex).__name__}: {str(ex)[:120]}")
            continue
        gbps = _bytes(N, K, 1) / sec / 1e9
        rows.append(dict(op="nvfp4 gemv sweep", case=f"{name} {N}x{K} M=1 {t}", us=sec * 1e6,
                         bytes=_bytes(N, K, 1), GBps=gbps, pct=100 * gbps * 1e9 / hbm))
        print(f"   {t}: {sec * 1e6:.1f} us {gbps:.0f} GB/s", flush=True)
        if best is None or sec < best[0]:
            best = (sec, t)
    print(f"  best gemv config {best}")
    ctx["gemv_best"] = best[1] if best else None
    del ws
    # every shape, heuristic config and the sweep's best; M=1 and (one shape) M=4, M=8
    for name, N, K in shapes:
        copies = _copies(_bytes(N, K, 1))
        ws = _rand_nvfp4(N, K, copies)
        for M in ((1, 4, 8) if name == shapes[0][0] else (1,)):
            x = torch.randn(M, K, device=DEV).bfloat16()
            for label, cfg in (("heuristic", None), ("best", _resolve(_cfg(best[1]), M, N, K) if best else None)):
                if cfg is None and label == "best":
                    continue
                sec = time_graph(lambda i: nvfp4_linear(x, *ws[i % copies], config=cfg), 2 * copies)
                gbps = _bytes(N, K, M) / sec / 1e9
                rows.append(dict(op="nvfp4 gemv", case=f"{name} {N}x{K} M={M} {label}", us=sec * 1e6,
                                 bytes=_bytes(N, K, M), GBps=gbps, pct=100 * gbps * 1e9 / hbm))
        del ws
    # FP8 per-tensor
    for name, N, K in [sh for sh in shapes if sh[0] in ("mamba.in_proj", "mamba.out_proj", "shared.up")]:
        nb = N * K + 2 * K + 2 * N
        copies = _copies(nb)
        ws = [(torch.randint(-100, 100, (N, K), device=DEV, dtype=torch.int8).view(torch.uint8)
               .bitwise_and(0x77).view(torch.float8_e4m3fn), torch.tensor(1e-3, device=DEV)) for _ in range(copies)]
        x = torch.randn(1, K, device=DEV).bfloat16()
        sec = time_graph(lambda i: fp8_linear(x, *ws[i % copies]), 2 * copies)
        rows.append(dict(op="fp8 gemv", case=f"{name} {N}x{K} M=1", us=sec * 1e6, bytes=nb,
                         GBps=nb / sec / 1e9, pct=100 * nb / sec / hbm))
        del ws
    # prefill GEMM: a chunk of 512 tokens through in_proj
    (q, s, gs), = _rand_nvfp4(*big, 1)
    Mp = ctx.get("prefill_rows", 512)
    x = torch.randn(Mp, big[1], device=DEV).bfloat16()
    e = rel_err(nvfp4_linear(x, q, s, gs, out_dtype=torch.float32), nvfp4_linear_torch(x, q, s, gs, torch.float32))
    checks.append(dict(check=f"nvfp4 gemm M={Mp}", rel_err=e, ok=e < 1e-4))
    for bm, bn, bk, nw in ((64, 128, 64, 8), (128, 128, 128, 8), (64, 128, 128, 4), (128, 64, 128, 4)):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)
        sec = time_graph(lambda i: nvfp4_linear(x, q, s, gs, config=cfg), 4)
        rows.append(dict(op="nvfp4 gemm", case=f"{big[0]}x{big[1]} M={Mp} {cfg}", us=sec * 1e6,
                         TFLOPs=2 * Mp * big[0] * big[1] / sec / 1e12))
    ctx["checks"].extend(checks)
    return rows


def _dump(out_dir, modes):
    """One launch per mode at 18,560 x 4,096 (the target for ncu) and the compiled code: TTGIR, PTX, SASS."""
    import os
    import subprocess
    import tempfile

    from kernels.gemv_nvfp4 import _fp8_gemm_kernel, _nvfp4_gemv_kernel

    (q, s, gs), = _rand_nvfp4(18560, 4096, 1)
    x = torch.randn(1, 4096, device=DEV).bfloat16()
    y = torch.empty(1, 18560, device=DEV, dtype=torch.bfloat16)
    kernels = []
    for mode in modes:
        bk = 256
        k = _nvfp4_gemv_kernel[(triton.cdiv(18560, 64), 1)](
            x, q, s.view(torch.uint8), gs.reshape(1), y, 1, 18560, 4096, 4096, 18560,
            M_PAD=1, BLOCK_N=64, BLOCK_K=bk, SPLIT_K=1, LOAD_MODE=mode, num_warps=4, num_stages=3)
        kernels.append((f"gemv_mode{mode}", k))
    f8 = torch.randint(0, 0x77, (18560, 4096), device=DEV, dtype=torch.uint8)
    y32 = torch.empty(1, 18560, device=DEV)
    k = _fp8_gemm_kernel[(triton.cdiv(18560, 64), 1)](x, f8, gs.reshape(1), y32, 1, 18560, 4096, 4096, 18560,
                                                       BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    kernels.append(("fp8_gemm", k))
    torch.cuda.synchronize()
    if not out_dir:
        return
    for name, k in kernels:
        if k is None or not hasattr(k, "asm"):
            print(f"{name}: launch returned no compiled kernel")
            continue
        parts = []
        for key in ("ttgir", "ptx"):
            parts.append(f"// ===== {key} =====\n{k.asm.get(key, '')}")
        try:
            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(k.asm["cubin"])
            sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
            os.unlink(f.name)
        except Exception as e:  # noqa: BLE001
            sass = f"cuobjdump failed: {e}"
        parts.append(f"// ===== sass =====\n{sass}")
        meta = getattr(k, "metadata", None)
        parts.insert(0, f"// n_regs={getattr(k, 'n_regs', '?')} n_spills={getattr(k, 'n_spills', '?')} "
                        f"shared={getattr(meta, 'shared', '?')}")
        with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
            f.write("\n".join(parts))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="3,4")
    ap.add_argument("--dump", default="")
    a = ap.parse_args()
    _dump(a.dump, [int(m) for m in a.modes.split(",")])
