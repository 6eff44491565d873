"""A Linear's weight in its checkpoint precision, and the op that applies it.

Weights stay quantized in memory; `linear` decodes one weight at the moment it is used (on CUDA the Triton
GEMV reads the packed bytes directly; on CPU the plain-PyTorch twin dequantizes that one weight; kernels.backend
decides). There is never a full-precision copy of the whole model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import backend
from kernels.gemv_nvfp4 import fp8_linear, nvfp4_linear
from kernels.nvfp4 import decode_fp8, decode_nvfp4

FORMATS = ("nvfp4", "fp8", "dense")


@dataclass
class QuantizedWeight:
    fmt: str                       # 'nvfp4' | 'fp8' | 'dense'
    weight: torch.Tensor           # nvfp4: U8 [out, in/2]; fp8: e4m3 [out, in]; dense: float [out, in]
    weight_scale: torch.Tensor | None = None    # nvfp4: e4m3 [out, in/16]; fp8: f32 []
    weight_scale_2: torch.Tensor | None = None  # nvfp4: f32 [] global
    out_features: int = 0
    in_features: int = 0

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}")
        if not self.out_features:
            self.out_features = self.weight.shape[0]
        if not self.in_features:
            self.in_features = self.weight.shape[1] * (2 if self.fmt == "nvfp4" else 1)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        if self.fmt == "nvfp4":
            return decode_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype)
        if self.fmt == "fp8":
            return decode_fp8(self.weight, self.weight_scale, dtype)
        return self.weight.to(dtype)

    def to(self, device) -> "QuantizedWeight":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(self.fmt, mv(self.weight), mv(self.weight_scale), mv(self.weight_scale_2),
                               self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale, self.weight_scale_2)
                   if t is not None)


def linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """y = x @ W.T in x's dtype; W decoded from its stored precision."""
    if w.fmt == "nvfp4" and backend.use_triton(x, "gemv_nvfp4"):
        return nvfp4_linear(x, w.weight, w.weight_scale, w.weight_scale_2)
    if w.fmt == "fp8" and backend.use_triton(x, "gemv_nvfp4"):
        return fp8_linear(x, w.weight, w.weight_scale)
    return F.linear(x, w.dequantize(x.dtype))
