"""SASS instructions per weight, registers and resident programs per SM of the NVFP4 / FP8 decode GEMV's variants,
compiled for a named GPU without one (no device time): the counts bench/NOTES.md's fixed-cost section quotes.

    python -m bench.kernels.gemv_nvfp4_sass [--arch 90] [--only build,last]
    PYTHONPATH=/tmp/triton36 python -m bench.kernels.gemv_nvfp4_sass    # with the device's Triton
        (pip install --no-deps --target /tmp/triton36 triton==3.6.0)

Per variant: the loop body (bench.kernels.sass_probe.loop_body) over the weights one thread handles per K-tile,
registers from cuobjdump's resource usage, and the programs one SM holds (registers, shared memory, 228 KB).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.kernels.sass_probe import loop_body, sass
from kernels import gemv_nvfp4 as g

_SIZES = ("K", "N", "stride_xm", "stride_ym", "row_q", "row_s")
# label -> (kernel, LOAD_MODE or 'fp8', M_PAD, BLOCK_N, num_warps, num_stages, split, maxnreg, flags)
VARIANTS = {
    "m8 M1 BN64 default": ("nvfp4", 8, 1, 64, 4, 3, 1, None, {}),
    "m8 M1 BN64 build": ("nvfp4", 8, 1, 64, 4, 3, 1, None, dict(X_BUILD=True)),
    "m8 M1 BN64 last": ("nvfp4", 8, 1, 64, 4, 3, 2, None, dict(SPLIT_REDUCE=1)),
    "m8 M1 BN64 build+last": ("nvfp4", 8, 1, 64, 4, 3, 2, None, dict(X_BUILD=True, SPLIT_REDUCE=1)),
    "m8 M1 BN64 build r80": ("nvfp4", 8, 1, 64, 4, 3, 1, 80, dict(X_BUILD=True)),
    "m8 M1 BN64 build one-dot": ("nvfp4", 8, 1, 64, 4, 3, 1, None, dict(X_BUILD=True, ONE_DOT=True)),
    "m8 M1 BN64 x-inline (old)": ("nvfp4", 8, 1, 64, 4, 3, 1, None, dict(X_INLINE=True)),
    "m8 M1 BN128 default": ("nvfp4", 8, 1, 128, 4, 3, 1, None, {}),
    "m8 M1 BN128 build": ("nvfp4", 8, 1, 128, 4, 3, 1, None, dict(X_BUILD=True)),
    "m8 M1 BN128 build r128": ("nvfp4", 8, 1, 128, 4, 3, 1, 128, dict(X_BUILD=True)),
    "m8 M1 BN128 w8 build": ("nvfp4", 8, 1, 128, 8, 3, 1, None, dict(X_BUILD=True)),
    "m8 M1 BN32 w2 build": ("nvfp4", 8, 1, 32, 2, 3, 1, None, dict(X_BUILD=True)),
    "m8 M2 BN128 default": ("nvfp4", 8, 2, 128, 4, 3, 1, None, {}),
    "m8 M2 BN128 build": ("nvfp4", 8, 2, 128, 4, 3, 1, None, dict(X_BUILD=True)),
    "m9 M8 BN64 default": ("nvfp4", 9, 8, 64, 4, 3, 1, None, {}),
    "m9 M8 BN64 build": ("nvfp4", 9, 8, 64, 4, 3, 1, None, dict(X_BUILD=True)),
    "m9 M8 BN128 x-inline (default)": ("nvfp4", 9, 8, 128, 4, 3, 1, None, dict(X_INLINE=True)),
    "m9 M8 BN128 prepared": ("nvfp4", 9, 8, 128, 4, 3, 1, None, {}),
    "m9 M8 BN128 build": ("nvfp4", 9, 8, 128, 4, 3, 1, None, dict(X_BUILD=True)),
    "fp8 M1 default": ("fp8", None, 1, 64, 4, 4, 1, None, {}),
    "fp8 M1 build": ("fp8", None, 1, 64, 4, 4, 1, None, dict(X_BUILD=True)),
    "fp8 M1 last": ("fp8", None, 1, 64, 4, 4, 2, None, dict(SPLIT_REDUCE=1)),
    "fp8 M8 build": ("fp8", None, 8, 64, 4, 4, 1, None, dict(X_BUILD=True)),
    # session 7 (h27): STREAM_K (balanced shares, one launch) and SCALE_AHEAD (the scales one / two K-tiles ahead);
    # the loop counted is the innermost one with the tensor-core ops (the shares' row-block loop encloses it)
    "sk m8 M1 BN64": ("nvfp4_sk", 8, 1, 64, 4, 3, 1, None, {}),
    "sk m8 M1 BN64 sa1": ("nvfp4_sk", 8, 1, 64, 4, 3, 1, None, dict(SCALE_AHEAD=1)),
    "sk m8 M1 BN64 sa2": ("nvfp4_sk", 8, 1, 64, 4, 3, 1, None, dict(SCALE_AHEAD=2)),
    "sk m8 M1 BN64 build": ("nvfp4_sk", 8, 1, 64, 4, 3, 1, None, dict(X_BUILD=True)),
    "sk m8 M1 BN64 build sa1": ("nvfp4_sk", 8, 1, 64, 4, 3, 1, None, dict(X_BUILD=True, SCALE_AHEAD=1)),
    "sk m8 M1 BN64 sa1 r96": ("nvfp4_sk", 8, 1, 64, 4, 3, 1, 96, dict(SCALE_AHEAD=1)),
    "sk m8 M1 BN128 sa1": ("nvfp4_sk", 8, 1, 128, 4, 3, 1, None, dict(SCALE_AHEAD=1)),
    "sk m8 M2 BN128": ("nvfp4_sk", 8, 2, 128, 4, 3, 1, None, {}),
    "sk m8 M2 BN128 sa1": ("nvfp4_sk", 8, 2, 128, 4, 3, 1, None, dict(SCALE_AHEAD=1)),
    "sk m9 M4 BN128": ("nvfp4_sk", 9, 4, 128, 4, 3, 1, None, {}),
    "sk m9 M8 BN64": ("nvfp4_sk", 9, 8, 64, 4, 3, 1, None, {}),
    "sk m9 M8 BN64 sa1": ("nvfp4_sk", 9, 8, 64, 4, 3, 1, None, dict(SCALE_AHEAD=1)),
    "sk m8 M1 BN64 build xa": ("nvfp4_sk", 8, 1, 64, 4, 3, 1, None, dict(X_BUILD=True, X_AHEAD=True)),
    "sk m8 M1 BN64 build xa sa1": ("nvfp4_sk", 8, 1, 64, 4, 3, 1, None, dict(X_BUILD=True, X_AHEAD=True, SCALE_AHEAD=1)),
    "sk m8 M1 BN32 w2 build xa sa1": ("nvfp4_sk", 8, 1, 32, 2, 3, 1, None,
                                      dict(X_BUILD=True, X_AHEAD=True, SCALE_AHEAD=1)),
    "sk m9 M8 BN64 build xa": ("nvfp4_sk", 9, 8, 64, 4, 3, 1, None, dict(X_BUILD=True, X_AHEAD=True)),
    "m8 M1 BN64 default sa1": ("nvfp4", 8, 1, 64, 4, 3, 1, None, dict(SCALE_AHEAD=1)),
    "sk fp8 M1": ("fp8_sk", None, 1, 64, 4, 4, 1, None, {}),
    "sk fp8 M1 build": ("fp8_sk", None, 1, 64, 4, 4, 1, None, dict(X_BUILD=True)),
}


def inner_mma_loop(text: str):
    """Opcode counts of the shortest backward-branch loop that holds a tensor-core op (HGMMA / HMMA)."""
    from collections import Counter
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,5})\*/\s+(.*?);", text)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = ins[at[int(m.group(1), 16)]: i + 1]
            if any("MMA" in x for _, x in body) and (best is None or len(body) < len(best)):
                best = body
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in (best or []))


def compile_variant(kernel, mode, m_pad, bn, nw, stages, split, maxnreg, flags, arch):
    """The kernel as nvfp4_linear / fp8_gemv would launch it (pointers and sizes specialised as multiples of 16,
    M = 1 as a constant), compiled for sm_<arch>."""
    reduce_ = flags.get("SPLIT_REDUCE", 0) == 1
    if kernel == "nvfp4_sk":
        fn = g._nvfp4_gemv_sk_kernel
        sig = dict(x_ptr="*bf16" if flags.get("X_BUILD") or flags.get("X_INLINE") else "*fp16", w_ptr="*u8",
                   s_ptr="*u8", gs_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32",
                   K="i32", stride_xm="i32", stride_ym="i32", row_q="i32", row_s="i32", n_tiles="i32", per="i32",
                   J_MAX="i32")
        cx = dict(M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=256 // m_pad if mode == 8 else 256, LOAD_MODE=mode,
                  USE_ASM=True, X_INLINE=False, X_BUILD=False, ONE_DOT=False, SCALE_AHEAD=0, X_AHEAD=False, PDL=False, PREFETCH=False)
    elif kernel == "fp8_sk":
        fn = g._fp8_gemv_sk_kernel
        sig = dict(xc_ptr="*bf16" if flags.get("X_BUILD") else "*fp16", w_ptr="*u8", scale_ptr="*fp32",
                   y_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", K="i32", stride_ym="i32",
                   n_tiles="i32", per="i32", J_MAX="i32", stride_xm="i32")
        cx = dict(BLOCK_N=bn, BLOCK_K=128, DIRECT=True, X_BUILD=False, ONE_ROW=m_pad == 1, PDL=False, PREFETCH=False)
    elif kernel == "nvfp4":
        fn = g._nvfp4_gemv_kernel
        sig = dict(x_ptr="*bf16" if flags.get("X_BUILD") or flags.get("X_INLINE") else "*fp16", w_ptr="*u8",
                   s_ptr="*u8", gs_ptr="*fp32", y_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32",
                   stride_ym="i32", row_q="i32", row_s="i32")
        cx = dict(M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=256 // m_pad if mode == 8 else 256, SPLIT_K=split, LOAD_MODE=mode,
                  USE_ASM=True, X_INLINE=False, X_BUILD=False, ONE_DOT=False, SPLIT_REDUCE=0, SCALE_AHEAD=0, X_AHEAD=False, PDL=False, PREFETCH=False)
    else:
        fn = g._fp8_gemv_kernel
        sig = dict(xc_ptr="*bf16" if flags.get("X_BUILD") else "*fp16", w_ptr="*u8", scale_ptr="*fp32",
                   y_ptr="*bf16", M="i32", N="i32", K="i32", stride_ym="i32", stride_xm="i32")
        cx = dict(SPLIT_K=split, BLOCK_N=bn, BLOCK_K=128, DIRECT=True, X_BUILD=False, ONE_ROW=m_pad == 1,
                  SPLIT_REDUCE=0, PDL=False, PREFETCH=False)
    cx.update(flags)
    sig["d_ptr"] = "*fp16" if flags.get("X_BUILD") and (kernel.startswith("nvfp4") or m_pad == 1) else "constexpr"
    if not kernel.endswith("_sk"):
        sig["part_ptr"], sig["cnt_ptr"] = ("*fp32", "*i32") if reduce_ else ("constexpr", "constexpr")
    for k, v in sig.items():
        if v == "constexpr":
            cx[k] = None
    if m_pad == 1:
        sig["M"] = "constexpr"
        cx["M"] = 1
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*") or n in _SIZES}
    opts = dict(num_warps=nw, num_stages=stages, **(dict(maxnreg=maxnreg) if maxnreg else {}))
    return triton.compile(ASTSource(fn, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=opts)


def registers(kernel) -> int:
    path = f"/tmp/gemv_nvfp4_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    try:
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    return int(re.search(r"REG:(\d+)", out).group(1))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90 H200, 120 RTX 5060)")
    ap.add_argument("--only", default="", help="comma-separated substrings of the variant labels")
    a = ap.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_{a.arch}")
    for label, (kernel, mode, m_pad, bn, nw, stages, split, maxnreg, flags) in VARIANTS.items():
        if a.only and not any(w in label for w in a.only.split(",")):
            continue
        k = compile_variant(kernel, mode, m_pad, bn, nw, stages, split, maxnreg, flags, a.arch)
        body = inner_mma_loop(sass(k)) if kernel.endswith("_sk") else loop_body(sass(k))
        n = sum(body.values())
        block_k = 128 if kernel.startswith("fp8") else (256 // m_pad if mode == 8 else 256)
        per_weight = n / (bn * block_k / (32 * nw))
        regs, smem = registers(k), k.metadata.shared
        per_sm = min(65536 // (regs * 32 * nw), 228 * 1024 // (smem + 1024), 32)
        print(f"  {label:32s} {per_weight:5.2f} instructions/weight  {regs:3d} registers  smem {smem // 1024:3d} KB  "
              f"{per_sm} programs/SM ({per_sm * nw} warps)  {dict(body.most_common(5))}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
