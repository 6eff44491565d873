"""RMSNorm and the gated, grouped RMSNorm of the Mamba2 mixer, as transformers' NemotronH computes them."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32, multiply by the weight in fp32, then cast (unlike Llama's order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def gated_group_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float) -> torch.Tensor:
    """y * silu(gate) first (norm_before_gate=False), then RMS over each group of `group_size` channels.
    Returns fp32 (the mixer feeds it to out_proj after one cast)."""
    yf = y.float() * F.silu(gate.float())
    *lead, n = yf.shape
    g = yf.view(*lead, n // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * g.view(*lead, n)
