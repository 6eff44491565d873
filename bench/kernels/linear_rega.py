"""The dense rega linear's Gluon kernel (kernels/linear_rega_gluon.py) compiled offline for sm_90 with the installed
Triton, no GPU needed: its registers, spill stack, shared memory and wgmma operand hazards (bench/kernels/sass_probe),
the CPU's only check of a Gluon kernel (Gluon has no interpreter). Its timings are bench/kernels/dense_prefill.py's
"rega" candidate.

    python -m bench.kernels.linear_rega        # (without TRITON_INTERPRET) prints the report as JSON
"""
from __future__ import annotations

import json

_ARG_TYPES = dict(w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", y_ptr="*bf16", M="i32", N="i32", K="i32",
                  stride_ym="i32")
_ALIGNED = {"w_ptr", "s_ptr", "gs_ptr", "y_ptr", "N", "K", "stride_ym"}


def compile_offline(config: dict | None = None, arch: int = 90):
    """`_rega_linear_kernel` as the engine launches it (kernels.expert_prefill_rega_gluon.TMA_CONFIG; pointers 16-byte
    aligned, N / K / stride divisible by 16, M varying), compiled for `arch`."""
    from bench.kernels.expert_prefill_rega_gluon import compile_gluon
    from kernels.expert_prefill_rega_gluon import TMA_CONFIG
    from kernels.linear_rega_gluon import _rega_linear_kernel
    return compile_gluon(_rega_linear_kernel, {**TMA_CONFIG, **(config or {})}, _ARG_TYPES, _ALIGNED, arch)


def compile_report(config: dict | None = None, arch: int = 90) -> dict:
    from bench.kernels.sass_probe import resources, sass, wgmma_operand_hazards
    k = compile_offline(config, arch)
    regs, spill = resources(k)
    return dict(config=config or {}, arch=arch, regs=regs, spill=spill, shared=k.metadata.shared,
                hazards=wgmma_operand_hazards(sass(k)))


if __name__ == "__main__":
    print(json.dumps(compile_report()))
