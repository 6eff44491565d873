"""The VRAM MoE layer's kernels (kernels/expert_vram.py) compiled for sm_90 without a GPU: registers, spills,
shared memory, programs per SM and SASS instructions per weight of each bench.kernels.moe_vram variant (no device
time; the device's Triton with PYTHONPATH=/tmp/triton36, as bench/kernels/gemv_nvfp4_sass.py).

    python -m bench.kernels.moe_vram_sass
"""
from __future__ import annotations

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.kernels.sass_probe import loop_body, resources, sass
from kernels import expert_up as eu
from bench.kernels import moe_vram_layer
from bench.kernels import vram_down_variants as losers
from kernels import expert_vram as v
from kernels import sparse_down as sd

_DIV16 = ("L", "I", "up_scales_off", "down_off", "row_q", "row_s")

UP = [dict(BLOCK_N=bn, X_BUILD=b, num_warps=w) for b, bn, w in
      ((False, 64, 4), (False, 32, 2), (False, 128, 4), (False, 128, 8), (True, 64, 4), (True, 128, 4))]
DOWN = [dict(GROUPS_PER_PROG=g, BLOCK_L=bl, QUAD=q) for g, bl, q in
        ((2, 512, False), (4, 512, False), (4, 256, False), (8, 256, False), (8, 128, False), (16, 128, False),
         (4, 256, True), (8, 256, True), (8, 128, True), (16, 128, True))] + [
    dict(GROUPS_PER_PROG=g, BLOCK_L=bl, DOT=True) for g, bl in ((16, 256), (16, 128), (8, 256), (4, 256))] + [
    dict(GROUPS_PER_PROG=g, BLOCK_L=bl, COMPACT=c) for g, bl, c in ((16, 256, 2), (16, 256, 4), (32, 256, 4),
                                                                     (8, 256, 2), (16, 128, 1), (32, 512, 2))]
FUSED = [dict(BLOCK_N=64, BLOCK_L=256, QUAD=False), dict(BLOCK_N=128, BLOCK_L=128, QUAD=False),
         dict(BLOCK_N=64, BLOCK_L=256, QUAD=True), dict(BLOCK_N=128, BLOCK_L=128, QUAD=True)]


def _compile(fn, sig, cx, nw, stages):
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*") or n in _DIV16}
    return triton.compile(ASTSource(fn, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=nw, num_stages=stages))


def up(cfg):
    sig = dict(xb_ptr="*bf16" if cfg["X_BUILD"] else "*fp16", addr_ptr="*i64", gup_ptr="*fp32", out_ptr="*fp32",
               mask_ptr="*i8", d_ptr="*fp16", L="i32", I="i32", up_scales_off="i32", row_q="i32", row_s="i32",
               n_blocks="i32")
    return _compile(v._vram_up_kernel, sig, dict(BLOCK_N=cfg["BLOCK_N"], X_BUILD=cfg["X_BUILD"], USE_ASM=True),
                    cfg["num_warps"], 3), cfg["BLOCK_N"] * 256, cfg["num_warps"]     # per K-tile (the loop body)


def down(cfg):
    sig = dict(act_ptr="*fp32", mask_ptr="*i8", addr_ptr="*i64", gdown_ptr="*fp32", w_ptr="*fp32", acc_ptr="*fp32",
               count_ptr="*i8", L="i32", I="i32", down_off="i32")
    if cfg.get("COMPACT"):
        cx = dict(GROUPS_PER_PROG=cfg["GROUPS_PER_PROG"], BLOCK_L=cfg["BLOCK_L"], COUNT=False, USE_ASM=True,
                  SUB=cfg["COMPACT"])       # per weight: one trip of the loop over SUB groups
        return _compile(v._vram_down_compact_kernel, sig, cx, 4, 1), cfg["COMPACT"] * cfg["BLOCK_L"] * 16, 4
    if cfg.get("DOT"):
        cx = dict(GROUPS_PER_PROG=cfg["GROUPS_PER_PROG"], BLOCK_L=cfg["BLOCK_L"], COUNT=False, USE_ASM=True)
        return _compile(losers._vram_down_dot_kernel, sig, cx, 4, 1), cfg["GROUPS_PER_PROG"] * cfg["BLOCK_L"] * 16, 4
    cx = dict(GROUPS_PER_PROG=cfg["GROUPS_PER_PROG"], BLOCK_L=cfg["BLOCK_L"], COUNT=False, QUAD=cfg["QUAD"],
              USE_ASM=True)
    return _compile(losers._vram_down_kernel, sig, cx, 4, 1), cfg["GROUPS_PER_PROG"] * cfg["BLOCK_L"] * 16, 4


def fused(cfg):
    sig = dict(xb_ptr="*fp16", addr_ptr="*i64", gup_ptr="*fp32", gdown_ptr="*fp32", w_ptr="*fp32", acc_ptr="*fp32",
               count_ptr="*fp32", d_ptr="*fp16", L="i32", I="i32", up_scales_off="i32", down_off="i32", row_q="i32",
               row_s="i32", n_blocks="i32")
    cx = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_L=cfg["BLOCK_L"], X_BUILD=False, USE_ASM=True, COUNT=False,
              QUAD=cfg["QUAD"])
    return _compile(moe_vram_layer._vram_layer_kernel, sig, cx, 4, 3), cfg["BLOCK_N"] * 1024 * 2, 4


def today_up(cfg):
    """kernels/expert_up.py's kernel as the VRAM layers ran it before (its defaults: LOAD_MODE 4, BLOCK_N 64)."""
    sig = dict(x_ptr="*bf16", addr_ptr="*i64", gup_ptr="*fp32", out_ptr="*fp32", mask_ptr="*i8", L="i32", I="i32",
               up_scales_off="i32")
    cx = dict(FUSE_RELU2=True, BLOCK_N=64, BLOCK_K=256, LOAD_MODE=cfg["LOAD_MODE"], USE_ASM=True)
    return _compile(eu._expert_up_kernel, sig, cx, 4, 3), 64 * 256, 4     # per K-tile (the loop body)


def today_down(cfg):
    """kernels/sparse_down.py's kernel at its default (4 groups a program, BLOCK_L 1024)."""
    sig = dict(act_ptr="*fp32", mask_ptr="*i8", addr_ptr="*i64", gdown_ptr="*fp32", w_ptr="*fp32", acc_ptr="*fp32",
               count_ptr="*i8", L="i32", I="i32", down_off="i32")
    cx = dict(GROUPS_PER_PROG=cfg["GROUPS_PER_PROG"], BLOCK_L=1024, COUNT=False)
    return _compile(sd._sparse_down_kernel, sig, cx, 4, 1), 1024 * 16, 4     # per group (the loop body)




def main():
    print(f"Triton {triton.__version__}, sm_90")
    # instructions per weight: the up's per K-tile (its loop body), today's down per group (its loop body; at 1 group
    # a program the whole kernel), the compact down's per trip over SUB groups (its loop body), the grouped down's and
    # the fused kernel's over the whole kernel (no loop / two)
    for name, make, cfgs in (("today up", today_up, [dict(LOAD_MODE=4), dict(LOAD_MODE=8)]),
                             ("today down", today_down, [dict(GROUPS_PER_PROG=4), dict(GROUPS_PER_PROG=1)]),
                             ("up", up, UP), ("down", down, DOWN), ("fused", fused, FUSED)):
        for cfg in cfgs:
            try:
                k, weights, nw = make(cfg)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  {name:10s} {cfg}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            regs, stack = resources(k)
            text = sass(k)
            body = sum(loop_body(text).values()) if name in ("today up", "up") or cfg.get("COMPACT") or (
                name == "today down" and cfg["GROUPS_PER_PROG"] > 1) else 0
            n = body or len(re.findall(r"/\*[0-9a-f]{4,5}\*/\s+", text))
            per_sm = min(65536 // (regs * 32 * nw), 228 * 1024 // (k.metadata.shared + 1024), 32)
            print(f"  {name:10s} {str(cfg):60s} {regs:3d} regs  stack {stack:4d}  smem {k.metadata.shared // 1024:3d} KB"
                  f"  {per_sm:2d}/SM  {n:5d} SASS ({n / (weights / (32 * nw)):.2f} per weight)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
