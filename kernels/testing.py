"""Comparison helpers shared by the kernel tests and the GPU benchmark's correctness checks."""
from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; any NaN or inf in out gives inf (an unwritten poisoned output)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = ""):
    """Fail with the relative error and the worst element's index and values."""
    e = rel_err(out, ref)
    if not e <= tol:
        out, ref = out.detach().cpu(), ref.detach().cpu()
        d = (out.double() - ref.double()).abs()
        i = int(torch.nan_to_num(d, nan=float("inf")).flatten().argmax())
        raise AssertionError(f"{what}: rel err {e:.3g} > {tol:g}; worst at flat index {i} of {tuple(out.shape)}: "
                             f"{out.flatten()[i].item()} vs {ref.flatten()[i].item()}")
