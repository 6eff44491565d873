"""NVFP4 and FP8 codecs, exactly as ModelOpt writes checkpoints.

NVFP4 tensor of a Linear with logical weight W [out, in] (in % 16 == 0):
  weight          U8      [out, in/2]   e2m1 codes; low nibble = element 2k, high nibble = element 2k+1
  weight_scale    F8_E4M3 [out, in/16]  one scale per 16 consecutive inputs, row-major (not swizzled)
  weight_scale_2  F32     scalar        per-tensor global scale = amax(W) / (6 * 448)
  W[r, c] = E2M1[code(r, c)] * float(weight_scale[r, c // 16]) * weight_scale_2

FP8 per-tensor: weight F8_E4M3 [out, in] = W / weight_scale, weight_scale F32 scalar = amax / 448.

This module is the lowest floor of the project: plain torch, no imports from other packages here.
"""
from __future__ import annotations

import torch

BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# index = 4-bit code; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# decision bounds between neighbouring magnitudes; a value exactly on a bound goes to the even code
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_AT = (0.75, 1.75, 3.5)  # bounds where searchsorted lands on the odd code

_table_cache: dict[tuple, torch.Tensor] = {}


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    key = (str(device), dtype)
    t = _table_cache.get(key)
    if t is None:
        t = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
        _table_cache[key] = t
    return t


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """U8 [..., n/2] -> U8 codes [..., n], low nibble first."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"NVFP4 values must be uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """U8 codes [..., n] (n even) -> U8 [..., n/2], element 2k in the low nibble."""
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def fp8_to_float(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its raw uint8 bytes) -> float32."""
    if x.dtype == torch.uint8:
        x = x.view(torch.float8_e4m3fn)
    return x.to(torch.float32)


def decode_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2, dtype=torch.float32) -> torch.Tensor:
    """Dequantize a ModelOpt NVFP4 weight: [out, in/2] U8 + [out, in/16] e4m3 + global -> [out, in]."""
    out_f, half_in = weight.shape[-2], weight.shape[-1]
    n_in = half_in * 2
    if weight_scale.shape[-1] * BLOCK != n_in or weight_scale.shape[-2] != out_f:
        raise ValueError(f"NVFP4 scale shape {tuple(weight_scale.shape)} does not fit values {tuple(weight.shape)}")
    vals = e2m1_table(weight.device)[unpack_codes(weight).long()]
    scale = fp8_to_float(weight_scale)
    g = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device).reshape(())
    w = vals.view(*vals.shape[:-1], n_in // BLOCK, BLOCK) * (scale * g).unsqueeze(-1)
    return w.reshape(*vals.shape).to(dtype)


def _cast_e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scales) to e2m1 codes, ties to even, saturating at 6."""
    sign = (q < 0).to(torch.uint8)
    mag = q.abs()
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=q.device)
    code = torch.searchsorted(bounds, mag.contiguous(), right=False).to(torch.uint8)
    round_up = torch.zeros_like(mag, dtype=torch.bool)
    for b in _ROUND_UP_AT:
        round_up |= mag == b
    code = code + round_up.to(torch.uint8)
    return code | (sign << 3)


def global_scale_nvfp4(w: torch.Tensor) -> torch.Tensor:
    amax = w.detach().abs().amax().float()
    return (amax / (E2M1_MAX * E4M3_MAX)).reshape(())


def encode_nvfp4(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None):
    """Quantize like ModelOpt's NVFP4QTensor: returns (weight U8 [out,in/2], weight_scale e4m3 [out,in/16], weight_scale_2 F32 [])."""
    w = w.detach().float()
    out_f, n_in = w.shape
    if n_in % BLOCK:
        raise ValueError(f"NVFP4 needs in_features % 16 == 0, got {n_in}")
    g = global_scale_nvfp4(w) if weight_scale_2 is None else torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(())
    if float(g) == 0.0:
        g = torch.tensor(1.0 / (E2M1_MAX * E4M3_MAX))  # an all-zero tensor: any scale decodes to zeros
    blocks = w.view(out_f, n_in // BLOCK, BLOCK)
    block_scale = blocks.abs().amax(-1) / (E2M1_MAX * g)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    block_scale_fp8 = block_scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    q = blocks / (block_scale_fp8.float() * g).unsqueeze(-1)
    codes = _cast_e2m1_codes(q).view(out_f, n_in)
    return pack_codes(codes), block_scale_fp8, g.clone()


def decode_fp8(weight: torch.Tensor, weight_scale, dtype=torch.float32) -> torch.Tensor:
    s = torch.as_tensor(weight_scale, dtype=torch.float32, device=weight.device).reshape(())
    return (fp8_to_float(weight) * s).to(dtype)


def encode_fp8(w: torch.Tensor):
    """Per-tensor FP8 like ModelOpt: (weight e4m3, weight_scale F32 [] = amax / 448)."""
    w = w.detach().float()
    s = (w.abs().amax() / E4M3_MAX).reshape(())
    if float(s) == 0.0:
        s = torch.tensor(1.0)
    return (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s.clone()


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The must-fail twin: exchange the two 4-bit halves of every byte."""
    return ((packed & 0x0F) << 4) | (packed >> 4)
