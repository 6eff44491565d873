"""kernels.backend: the device picks the kernel or the twin; FORCED overrides per op or for all; bad values and
kernels on CPU tensors without the interpreter are refused by name."""
import pytest
import torch

from kernels import backend


def test_device_decides_by_default():
    assert backend.use_triton(torch.zeros(1), "mamba_step") is False
    if torch.cuda.is_available():
        assert backend.use_triton(torch.zeros(1, device="cuda"), "mamba_step") is True


def test_forced_per_op_and_for_all(monkeypatch):
    t = torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(backend, "FORCED", {"mamba_step": "twin"})
    assert backend.use_triton(t, "mamba_step") is False
    assert backend.use_triton(t, "attention_decode") is t.is_cuda         # other ops: by device
    monkeypatch.setattr(backend, "FORCED", {"*": "twin", "attention_decode": "triton"})
    assert backend.use_triton(t, "gemv_nvfp4") is False
    if t.is_cuda or backend.interpreted():
        assert backend.use_triton(t, "attention_decode") is True


def test_bad_choice_is_named(monkeypatch):
    monkeypatch.setattr(backend, "FORCED", {"mamba_step": "fast"})
    with pytest.raises(ValueError, match="mamba_step.*'fast'"):
        backend.use_triton(torch.zeros(1), "mamba_step")


def test_cpu_kernels_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(backend, "FORCED", {"*": "triton"})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.use_triton(torch.zeros(1), "sparse_down")
