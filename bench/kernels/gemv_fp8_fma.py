"""The FP8 FMA GEMV's experiments (issue 19, part 1; session 36): the SASS counts per variant for sm_90 without a GPU.
The kernel and its launcher are in kernels/gemv_fp8_fma.py (kernels.gemv_nvfp4.fp8_linear routes M = 1 there); they
are re-exported here for the sweep (bench.kernels.gemv_fma_sweep --fp8) and the notes.

    PYTHONPATH=/tmp/triton36:. python -m bench.kernels.gemv_fp8_fma --sass [--only LABEL,..]

(--sass compiles for sm_90 and must run without TRITON_INTERPRET; Triton 3.6 on a side path, see
bench.kernels.sass_probe.) The read probe is the kernel's PROBE flag: `fp8_linear_fma(..., probe=True)`.
"""
from __future__ import annotations

import triton

from kernels.gemv_fp8_fma import C_MAX, DECODE_FP8_PTX, _fp8_gemv_fma_kernel, fp8_fma_config, fp8_linear_fma, x_top

__all__ = ["C_MAX", "DECODE_FP8_PTX", "fp8_fma_config", "fp8_linear_fma", "x_top", "compile_sm90", "sass_counts"]


# ---- SASS counts (sm_90 without a GPU; Triton 3.6 on a side path, see bench.kernels.sass_probe)

SASS_VARIANTS = {   # label -> (M_PAD, C, R, num_warps, PROBE)
    "M1 C4 R1 w4 (default)": (1, 4, 1, 4, False),
    "M1 C8 R1 w4": (1, 8, 1, 4, False),
    "M1 C4 R2 w4": (1, 4, 2, 4, False),
    "M1 C2 R2 w4": (1, 2, 2, 4, False),
    "M1 C1 R4 w4": (1, 1, 4, 4, False),
    "M2 C2 R2 w4 (default)": (2, 2, 2, 4, False),
    "probe C4 R1 w4": (1, 4, 1, 4, True),
}


def compile_sm90(m_pad, c, r, nw, probe, split=True, arch=90):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = dict(x_ptr="*bf16", w_ptr="*u32", gs_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32" if split else "*bf16",
               cnt_ptr="*i32" if split else "*bf16", M="i32", N="i32", K="i32", stride_xm="i32", stride_ym="i32",
               row_w="i32", slice_w="i32", rows_per_prog="i32")
    cx = dict(M_PAD=m_pad, C=c, R=r, NUM_WARPS=nw, USE_ASM=True, SPLIT=split, X_TOP=x_top(c), PROBE=probe)
    if m_pad == 1:
        sig["M"] = "constexpr"
        cx["M"] = 1
    names = list(sig)
    div16 = [n for n in names if sig[n].startswith("*") or n in ("K", "N", "stride_xm", "stride_ym", "row_w",
                                                                 "slice_w")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(ASTSource(_fp8_gemv_fma_kernel, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=dict(num_warps=nw, num_stages=1))


def sass_counts(only: str = "") -> list[dict]:
    """Per variant: instructions per weight in the row loop (two row blocks a trip: a thread reads 2 x C x R x 16
    codes per trip), registers, programs per SM, opcode mix."""
    from bench.kernels.sass_probe import loop_body, resources, sass
    rows = []
    print(f"Triton {triton.__version__}, sm_90", flush=True)
    for label, (m_pad, c, r, nw, probe) in SASS_VARIANTS.items():
        if only and not any(w in label for w in only.split(",")):
            continue
        kern = compile_sm90(m_pad, c, r, nw, probe)
        body = loop_body(sass(kern))
        n = sum(body.values())
        regs, stack = resources(kern)
        per_sm = min(65536 // (max(regs, 1) * 32 * nw), 2048 // (32 * nw), 32)
        weights = 2 * c * r * 16
        rows.append(dict(label=label, per_weight=n / weights, loop=n, regs=regs, stack=stack, programs_per_sm=per_sm,
                         mix=dict(body.most_common(10))))
        print(f"  {label:22s} {n / weights:5.2f} instructions/weight ({n} per {weights})  {regs:3d} registers"
              f"{f' spill {stack} B' if stack else ''}  {per_sm} programs/SM  {dict(body.most_common(10))}",
              flush=True)
    return rows


if __name__ == "__main__":
    import argparse
    import sys
    ap = argparse.ArgumentParser(description="PYTHONPATH=/tmp/triton36:. python -m bench.kernels.gemv_fp8_fma --sass")
    ap.add_argument("--sass", action="store_true", help="count the SASS of the variants for sm_90 (no GPU needed)")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    if a.sass:
        sass_counts(a.only)
    sys.exit(0)
