"""A Linear's weight in its checkpoint precision, and the op that applies it.

Weights stay quantized in memory; `linear` decodes one weight at the moment it is used (on CUDA the Triton
GEMV reads the packed bytes directly; on CPU the plain-PyTorch twin dequantizes that one weight; kernels.backend
decides). There is never a full-precision copy of the whole model: at prefill size a layer's own weights may be
decoded for the layer's pieces and freed when it is done (`kernels.dense_prefill.held`, opened by
`nemotron.model.NemotronH.forward`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import backend, dense_prefill, linear_rega
from kernels.gemv_bf16 import bf16_linear_routed
from kernels.gemv_nvfp4 import DECODE_MAX_ROWS, fp8_linear, nvfp4_linear
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
    scale_host: float | None = None  # the global scale (nvfp4: weight_scale_2, fp8: weight_scale) as a host number

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}")
        if not self.out_features:
            self.out_features = self.weight.shape[0]
        if not self.in_features:
            self.in_features = self.weight.shape[1] * (2 if self.fmt == "nvfp4" else 1)
        g = self._global()
        if self.scale_host is None and g is not None and g.device.type == "cpu" and g.numel() == 1:   # no sync here
            self.scale_host = float(g.reshape(()))

    def _global(self) -> torch.Tensor | None:
        return {"nvfp4": self.weight_scale_2, "fp8": self.weight_scale}.get(self.fmt)

    def global_host(self) -> float:
        """The global scale as a host number (the dequantized GEMM's alpha); read from the device once if the
        weight was made there."""
        if self.scale_host is None:
            g = self._global()
            if g is None:
                raise ValueError(f"a {self.fmt!r} weight has no global scale")
            self.scale_host = float(g.reshape(()))
        return self.scale_host

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        if self.fmt == "nvfp4":
            return decode_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype)
        if self.fmt == "fp8":
            return decode_fp8(self.weight, self.weight_scale, dtype)
        return self.weight.to(dtype)

    def to(self, device) -> "QuantizedWeight":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(self.fmt, mv(self.weight), mv(self.weight_scale), mv(self.weight_scale_2),
                               self.out_features, self.in_features, self.scale_host)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale, self.weight_scale_2)
                   if t is not None)


def linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """y = x @ W.T in x's dtype; W decoded from its stored precision. Inside a layer's `dense_prefill.held` scope,
    more rows than a GEMV's multiply W's decoded copy by cuBLAS (decoded once for all of the span's pieces); an NVFP4
    weight no decoded copy takes runs the rega linear where it is able (kernels/linear_rega.py), else the tile
    kernel."""
    cache = dense_prefill.active() if w.fmt != "dense" else None
    if cache is not None and x.numel() > DECODE_MAX_ROWS * x.shape[-1] and cache.takes(w):
        x2 = x.reshape(-1, x.shape[-1])
        y = cache.linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), w)
        if y is not None:
            return y.reshape(*x.shape[:-1], w.out_features)
    if w.fmt == "nvfp4" and linear_rega.rega_linear_able(x, w.weight):     # (sm_90, MOESTREAM_DENSE_REGA)
        return linear_rega.rega_linear(x, w.weight, w.weight_scale, w.weight_scale_2)
    if w.fmt == "nvfp4" and backend.use_triton(x, "gemv_nvfp4"):
        return nvfp4_linear(x, w.weight, w.weight_scale, w.weight_scale_2)
    if w.fmt == "fp8" and backend.use_triton(x, "gemv_nvfp4"):
        return fp8_linear(x, w.weight, w.weight_scale)
    if w.fmt == "dense" and backend.use_triton(x, "gemv_nvfp4"):
        y = bf16_linear_routed(x, w.weight)     # the lm_head and the bf16 in_proj at M = 1 (kernels/gemv_bf16.py)
        if y is not None:
            return y
    return F.linear(x, w.dequantize(x.dtype))
