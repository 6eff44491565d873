"""Which implementation an op runs, its Triton kernel or its plain-PyTorch twin: decided here and only here.

By device: CUDA tensors run the kernels, CPU tensors the twins. `FORCED` overrides that per op (the name is the
op's module under kernels/, e.g. "mamba_step") or for all ops ("*"); the tests use it to compare the two paths
on one device, or to run the kernels on CPU tensors, which needs Triton's interpreter (TRITON_INTERPRET=1 set
before any kernel is defined: tests/conftest.py does it where there is no GPU):

    monkeypatch.setattr(backend, "FORCED", {"mamba_step": "triton", "attention_decode": "triton"})
"""
from __future__ import annotations

import os

import torch

CHOICES = ("triton", "twin")
FORCED: dict[str, str] = {}


def interpreted() -> bool:
    """Triton runs under its interpreter (kernels execute on the CPU, with numpy semantics)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor, op: str) -> bool:
    """True when `op` on tensors like `t` runs its Triton kernel, False for its twin."""
    choice = FORCED.get(op, FORCED.get("*"))
    if choice is None:
        return t.is_cuda
    if choice not in CHOICES:
        raise ValueError(f"kernels.backend.FORCED[{op!r}] = {choice!r}: expected one of {CHOICES}")
    if choice == "triton" and not t.is_cuda and not interpreted():
        raise RuntimeError(f"{op}: Triton kernels on CPU tensors need TRITON_INTERPRET=1 "
                           "set before the kernels are imported")
    return choice == "triton"
