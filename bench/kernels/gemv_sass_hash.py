"""A hash of the sm_90 SASS of the decode GEMVs' default paths, to show that a change left them as measured (no device).

    git archive <commit> kernels | tar -x -C /tmp/ref
    PYTHONPATH=/tmp/triton36:/tmp/ref:. python bench/kernels/gemv_sass_hash.py > ref.txt    # the reference tree
    PYTHONPATH=/tmp/triton36:. python bench/kernels/gemv_sass_hash.py > now.txt             # this tree
    diff ref.txt now.txt
(run as a file, not with -m: -m puts this tree's root before /tmp/ref on the path; stderr names the tree used)

One line per variant: the SASS instructions (addresses and encodings stripped) hashed, and their count. Session 7
(h27) used it against main 620a50e (the split kernel's variants) and against run 1's commit ff25f9b (STREAM_K's and
FP8's): identical once the flags were added. Kernels a reference tree lacks are skipped; flags it lacks are dropped.
"""
from __future__ import annotations

import hashlib
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.kernels.sass_probe import sass
from kernels import gemv_nvfp4 as g

_DIV16 = ("K", "N", "stride_xm", "stride_ym", "row_q", "row_s")
_BASE = dict(w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", y_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32",
             stride_ym="i32", row_q="i32", row_s="i32")


def _compile(fn, sig: dict, cx: dict, num_warps: int, num_stages: int):
    names = list(fn.arg_names)
    for n in ("PDL", "PREFETCH", "X_AHEAD"):          # the flags off, where the tree has them
        if n in names:
            cx.setdefault(n, False)
    sig = {n: sig.get(n, "constexpr") for n in names}
    cx = {n: cx.get(n) for n in names if sig[n] == "constexpr"}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*") or n in _DIV16}
    return triton.compile(ASTSource(fn, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _digest(kernel) -> tuple[str, int]:
    lines = [re.sub(r"/\*[0-9a-f]+\*/", "", ln).split(";")[0].strip() for ln in sass(kernel).splitlines()
             if re.search(r"/\*[0-9a-f]{4,5}\*/", ln)]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12], len(lines)


def _nvfp4(mode, m_pad, bn, build=False, split=1, reduce_=0, inline=False):
    sig = dict(_BASE, x_ptr="*bf16" if build or inline else "*fp16")
    cx = dict(M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=256 // m_pad if mode == 8 else 256, SPLIT_K=split, LOAD_MODE=mode,
              USE_ASM=True, X_INLINE=inline, X_BUILD=build, ONE_DOT=False, SPLIT_REDUCE=reduce_, SCALE_AHEAD=0)
    if build:
        sig["d_ptr"] = "*fp16"
    if reduce_:
        sig.update(part_ptr="*fp32", cnt_ptr="*i32")
    if m_pad == 1:
        sig["M"], cx["M"] = "constexpr", 1
    return "_nvfp4_gemv_kernel", sig, cx


def _nvfp4_sk(mode, m_pad, bn, build=False):
    sig = dict(_BASE, x_ptr="*bf16" if build else "*fp16", part_ptr="*fp32", cnt_ptr="*i32", n_tiles="i32",
               per="i32", J_MAX="i32")
    cx = dict(M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=256 // m_pad if mode == 8 else 256, LOAD_MODE=mode, USE_ASM=True,
              X_INLINE=False, X_BUILD=build, ONE_DOT=False, SCALE_AHEAD=0)
    if build:
        sig["d_ptr"] = "*fp16"
    if m_pad == 1:
        sig["M"], cx["M"] = "constexpr", 1
    return "_nvfp4_gemv_sk_kernel", sig, cx


def _fp8(one_row, build=False, split=1, reduce_=0, stream_k=False):
    sig = dict(xc_ptr="*bf16" if build else "*fp16", w_ptr="*u8", scale_ptr="*fp32", y_ptr="*bf16", M="i32", N="i32",
               K="i32", stride_ym="i32", stride_xm="i32")
    cx = dict(BLOCK_N=64, BLOCK_K=128, DIRECT=True, X_BUILD=build, ONE_ROW=one_row)
    if stream_k:
        sig.update(part_ptr="*fp32", cnt_ptr="*i32", n_tiles="i32", per="i32", J_MAX="i32")
    else:
        cx.update(SPLIT_K=split, SPLIT_REDUCE=reduce_)
        if reduce_:
            sig.update(part_ptr="*fp32", cnt_ptr="*i32")
    if build and one_row:
        sig["d_ptr"] = "*fp16"
    return "_fp8_gemv_sk_kernel" if stream_k else "_fp8_gemv_kernel", sig, cx


# label -> (kernel name, signature, constexprs), num_warps, num_stages
CASES = {
    "nv m8 M1 BN64": (_nvfp4(8, 1, 64), 4, 3),
    "nv m8 M1 BN64 last": (_nvfp4(8, 1, 64, split=2, reduce_=1), 4, 3),
    "nv m8 M1 BN32 build last": (_nvfp4(8, 1, 32, build=True, split=2, reduce_=1), 2, 3),
    "nv m9 M8 BN64": (_nvfp4(9, 8, 64), 4, 3),
    "nv m9 M8 BN128 inline": (_nvfp4(9, 8, 128, inline=True), 4, 3),
    "sk m8 M1 BN64": (_nvfp4_sk(8, 1, 64), 4, 3),
    "sk m8 M2 BN128 build": (_nvfp4_sk(8, 2, 128, build=True), 4, 3),
    "sk m9 M4 BN64": (_nvfp4_sk(9, 4, 64), 4, 3),
    "sk m9 M8 BN64": (_nvfp4_sk(9, 8, 64), 4, 3),
    "sk m9 M2 BN128 build": (_nvfp4_sk(9, 2, 128, build=True), 4, 3),
    "fp8 M1": (_fp8(True), 4, 4),
    "fp8 M1 split": (_fp8(True, split=2), 4, 4),
    "fp8 M8 build last": (_fp8(False, build=True, split=2, reduce_=1), 4, 4),
    "fp8sk M1": (_fp8(True, stream_k=True), 4, 4),
    "fp8sk M8 build": (_fp8(False, build=True, stream_k=True), 4, 4),
}


def main() -> int:
    print(f"# {g.__file__}, Triton {triton.__version__}", file=sys.stderr)
    for label, ((name, sig, cx), nw, stages) in CASES.items():
        fn = getattr(g, name, None)
        if fn is None:
            continue
        print(label, *_digest(_compile(fn, dict(sig), dict(cx), nw, stages)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
