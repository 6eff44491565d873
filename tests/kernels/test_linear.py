"""kernels.linear: each stored format against the dense product, through the twin and through the GEMV kernels
(the path kernels.backend picks on CUDA; forced here on the CPU under the interpreter)."""
import pytest
import torch

from kernels import backend
from kernels.linear import QuantizedWeight, linear
from kernels.nvfp4 import encode_fp8, encode_nvfp4
from kernels.testing import assert_close


def _weight(fmt, N, K, device):
    w = torch.randn(N, K)
    if fmt == "nvfp4":
        return QuantizedWeight("nvfp4", *encode_nvfp4(w)).to(device)
    if fmt == "fp8":
        return QuantizedWeight("fp8", *encode_fp8(w)).to(device)
    return QuantizedWeight("dense", w.bfloat16()).to(device)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "dense"])
@pytest.mark.parametrize("path", ["triton", "twin"])
def test_linear_equals_dequantized_product(fmt, path, device, monkeypatch):
    monkeypatch.setattr(backend, "FORCED", {"gemv_nvfp4": path})
    qw = _weight(fmt, 24, 80, device)
    x = torch.randn(3, 80, device=device)
    y = linear(x, qw)
    assert y.shape == (3, 24) and y.dtype == x.dtype
    # fp32 x enters the tensor cores as fp16 on the kernel path: ~2^-12 relative
    assert_close(y, x @ qw.dequantize().t(), 1e-3 if path == "triton" and fmt != "dense" else 1e-5, f"{fmt} {path}")


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown weight format 'int4'"):
        QuantizedWeight("int4", torch.zeros(2, 2))
