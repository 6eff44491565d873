"""The FMA GEMV's experiments (issue 19, part 1; session 12, h-gemv): the SASS counts per variant for sm_90 without a
GPU, and the names the sweep and older notes use. The kernel and its launcher moved to kernels/gemv_nvfp4_fma.py in
session 13 (h-fmaroute), where kernels.gemv_nvfp4.nvfp4_linear routes the shapes it won at M = 1; they are
re-exported here so that `from bench.kernels import gemv_nvfp4_fma` keeps working.

    PYTHONPATH=/tmp/triton36:. python -m bench.kernels.gemv_nvfp4_fma --sass [--only LABEL,..] [--show]

(--sass compiles for sm_90 and must run without TRITON_INTERPRET; Triton 3.6 on a side path, see
bench.kernels.sass_probe.) The read probe is the kernel's PROBE flag: `nvfp4_linear_fma(..., probe=True)`.
"""
from __future__ import annotations

import sys

import triton

from kernels.gemv_nvfp4_fma import (CHAIN_PTX, DECODE_PTX, LANES_PTX, TAIL_PTX, X_TOP_EXP,  # noqa: F401
                                    _nvfp4_gemv_fma_kernel, fma_config, nvfp4_linear_fma)

# ---- SASS counts (sm_90 without a GPU; Triton 3.6 on a side path, see bench.kernels.sass_probe)

SASS_VARIANTS = {   # label -> (M_PAD, C, R, num_warps, PROBE, maxnreg)
    "M1 C4 R1 w4 (default)": (1, 4, 1, 4, False, None),
    "M1 C4 R2 w4": (1, 4, 2, 4, False, None),
    "M1 C2 R2 w4": (1, 2, 2, 4, False, None),
    "M1 C1 R4 w4": (1, 1, 4, 4, False, None),
    "M1 C4 R2 w4 r128": (1, 4, 2, 4, False, 128),
    "M2 C1 R2 w4 (default)": (2, 1, 2, 4, False, None),
    "M2 C2 R2 w4": (2, 2, 2, 4, False, None),
    "probe C4 R1 w4": (1, 4, 1, 4, True, None),
}


def compile_sm90(m_pad, c, r, nw, probe, maxnreg, split=False, arch=90):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = _nvfp4_gemv_fma_kernel
    sig = dict(x_ptr="*bf16", w_ptr="*u32", s_ptr="*u16", gs_ptr="*fp32", y_ptr="*bf16",
               part_ptr="*fp32" if split else "*bf16", cnt_ptr="*i32" if split else "*bf16", M="i32", N="i32",
               K="i32", stride_xm="i32", stride_ym="i32", row_w="i32", row_s2="i32", slice_w="i32",
               rows_per_prog="i32")
    cx = dict(M_PAD=m_pad, C=c, R=r, NUM_WARPS=nw, USE_ASM=True, SPLIT=split, PROBE=probe)
    if m_pad == 1:
        sig["M"] = "constexpr"
        cx["M"] = 1
    names = list(sig)
    div16 = [n for n in names if sig[n].startswith("*") or n in ("K", "N", "stride_xm", "stride_ym", "row_w",
                                                                 "row_s2", "slice_w")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    opts = dict(num_warps=nw, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(ASTSource(fn, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=opts)


def sass_counts(only: str = "", show: bool = False) -> list[dict]:
    """Per variant: instructions per weight in the row loop (the loop over row blocks: two blocks a trip, so a thread
    reads 2 x C x R x 32 codes per trip), registers, programs per SM (registers; 2,048 threads), opcode mix."""
    from bench.kernels.sass_probe import loop_body, resources, sass
    rows = []
    print(f"Triton {triton.__version__}, sm_90", flush=True)
    for label, (m_pad, c, r, nw, probe, maxnreg) in SASS_VARIANTS.items():
        if only and not any(w in label for w in only.split(",")):
            continue
        k = compile_sm90(m_pad, c, r, nw, probe, maxnreg)
        text = sass(k)
        if show:
            print(text)
        body = loop_body(text)
        n = sum(body.values())
        regs, stack = resources(k)
        per_sm = min(65536 // (max(regs, 1) * 32 * nw), 2048 // (32 * nw), 32)
        weights = 2 * c * r * 32
        row = dict(label=label, per_weight=n / weights, loop=n, regs=regs, stack=stack, smem=k.metadata.shared,
                   programs_per_sm=per_sm, mix=dict(body.most_common(10)))
        rows.append(row)
        print(f"  {label:22s} {n / weights:5.2f} instructions/weight ({n} per {weights})  {regs:3d} registers"
              f"{f' spill {stack} B' if stack else ''}  smem {k.metadata.shared // 1024} KB  {per_sm} programs/SM  "
              f"{dict(body.most_common(10))}", flush=True)
    return rows


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true", help="count the SASS of the variants for sm_90 (no GPU needed)")
    ap.add_argument("--only", default="")
    ap.add_argument("--show", action="store_true", help="print the whole SASS")
    a = ap.parse_args()
    if a.sass:
        sass_counts(a.only, a.show)
    sys.exit(0)
