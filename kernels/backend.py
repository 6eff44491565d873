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


def varying(*names: str) -> dict:
    """`triton.jit` keywords for arguments that change from call to call: ints such as a prompt's tile count, and
    pointers into a slice at any row. Triton otherwise compiles a kernel once per value class of each (== 1,
    divisible by 16, a 16-byte aligned pointer), so a prompt of a new length could stop on a 1–3 s compile in the
    middle of serving (bench.prefill, H200 session 5: a 1,000-token prompt took 3.3 s cold, 0.15 s warm)."""
    import inspect

    import triton
    params = inspect.signature(triton.jit).parameters
    return {k: list(names) for k in ("do_not_specialize", "do_not_specialize_on_alignment") if k in params}
