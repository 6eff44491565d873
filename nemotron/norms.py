"""RMSNorm and the gated, grouped RMSNorm of the Mamba2 mixer, as transformers' NemotronH computes them.

On CUDA each is one Triton launch (kernels/rms_norm.py); the functions here are their twins and the CPU path."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import backend
from kernels import rms_norm as _k


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Normalize in fp32, multiply by the weight in fp32, then cast (unlike Llama's order). `out`: where the
    result goes (the kernel writes it there; the twin copies)."""
    if backend.use_triton(x, "rms_norm"):
        return _k.rms_norm(x, weight, eps) if out is None else _k.rms_norm(x, weight, eps, out=out)
    y = rms_norm_torch(x, weight, eps)
    return y if out is None else out.copy_(y)


def gated_group_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float) -> torch.Tensor:
    """y * silu(gate) first (norm_before_gate=False), then RMS over each group of `group_size` channels.
    Returns fp32 (the mixer feeds it to out_proj after one cast)."""
    if backend.use_triton(y, "rms_norm"):
        return _k.gated_group_rms_norm(y, gate, weight, group_size, eps)
    return gated_group_rms_norm_torch(y, gate, weight, group_size, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Twin of kernels.rms_norm.rms_norm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def gated_group_rms_norm_torch(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                               eps: float) -> torch.Tensor:
    """Twin of kernels.rms_norm.gated_group_rms_norm."""
    yf = y.float() * F.silu(gate.float())
    *lead, n = yf.shape
    g = yf.view(*lead, n // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * g.view(*lead, n)
