"""RMSNorm and the Mamba2 mixer's gated, grouped RMSNorm, each one launch.

Why: the plain-PyTorch forms (nemotron/norms.py, the twins) run as 9 and 11 small kernels (casts, pow, mean, add,
rsqrt, two or three multiplies). A decode token has two norms per Mamba layer and one per other layer, so on the
super shape ~100 of a token's ~470 kernels were norms, each a few microseconds of launch and ramp on a
[1, 4096] row (bench/NOTES.md, "the dense stretch"). One program per row (per group for the gated form) reads
the row once, reduces in fp32 and writes the result; the arithmetic is the twins' in the same order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < N
    x = tl.load(x_ptr + r * N + o, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * N + o, (w * (x * inv)).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gated_group_rms_norm_kernel(y_ptr, g_ptr, w_ptr, out_ptr, N, G, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    o = grp * G + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < G
    y = tl.load(y_ptr + r * N + o, mask=m, other=0.0).to(tl.float32)
    z = tl.load(g_ptr + r * N + o, mask=m, other=0.0).to(tl.float32)
    v = y * (z / (1.0 + tl.exp(-z)))                  # y * silu(gate)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / G + eps)
    w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * N + o, w * (v * inv), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """nemotron.norms.rms_norm in one launch: x [..., N] -> same shape and dtype, into `out` when given (a decode
    graph's static buffer: no copy after the norm)."""
    N = x.shape[-1]
    if weight.numel() != N:
        raise ValueError(f"rms_norm: weight has {weight.numel()} elements for rows of {N}")
    xc = x.contiguous()
    if out is not None and (out.shape != xc.shape or out.dtype != xc.dtype or not out.is_contiguous()):
        raise ValueError(f"rms_norm: out is {out.dtype} {tuple(out.shape)}, expected contiguous {xc.dtype} "
                         f"{tuple(xc.shape)}")
    y = torch.empty_like(xc) if out is None else out
    rows = xc.numel() // N
    if rows:
        _rms_norm_kernel[(rows,)](xc, weight.contiguous(), y, N, float(eps), BLOCK=triton.next_power_of_2(N),
                                  num_warps=4 if N <= 4096 else 8)
    return y


def gated_group_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float) -> torch.Tensor:
    """nemotron.norms.gated_group_rms_norm in one launch: fp32 [..., N]."""
    N = y.shape[-1]
    if gate.shape != y.shape or weight.numel() != N or N % group_size:
        raise ValueError(f"gated_group_rms_norm: y {tuple(y.shape)}, gate {tuple(gate.shape)}, weight "
                         f"{weight.numel()}, groups of {group_size}: shapes do not agree")
    yc, gc = y.contiguous(), gate.contiguous()
    out = torch.empty(y.shape, dtype=torch.float32, device=y.device)
    rows = yc.numel() // N
    if rows:
        _gated_group_rms_norm_kernel[(rows, N // group_size)](
            yc, gc, weight.contiguous(), out, N, group_size, float(eps),
            BLOCK=triton.next_power_of_2(group_size), num_warps=4 if group_size <= 4096 else 8)
    return out
