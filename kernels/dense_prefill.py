"""Dense NVFP4 / FP8 linears at prefill size: the weight dequantized once per layer per span, each piece a cuBLAS GEMM.

At a prefill's row counts the tile-decoding GEMM (`kernels.gemv_nvfp4._nvfp4_gemm_kernel`) ran at ~22 % of the bf16
GEMM (H200, session 6 profile: 127.5 ms of a 16,000-token prompt's ~395 ms of device time). A layer's pieces
(`nemotron.model.Pieces`) each multiply the same weights, so the layer's weights are decoded once into a cache
that lives for the layer (`held`), and every piece runs `torch.Tensor.addmm_` on them. H200 (bench/NOTES.md, h22):
in_proj over a 16,000-token span 627 TFLOP/s (83 % of the bf16 GEMM) against the old kernel's 148; the engine's
16k prefill −105 ms of device time, −86 ms of wall (20 %) in an A/B in one process.

What the cache holds is exact: e2m1 · e4m3 (NVFP4) or e4m3 (FP8) in x's dtype — both fit bf16 and fp16 exactly
(NVFP4: ≤ 6 significant bits, 2^-10 ≤ |v| ≤ 2,688; e4m3: 4 bits, ≤ 448, subnormals down to 2^-9). The fp32 global
scale is not folded into the weight (that would round every weight to bf16): it is the GEMM's alpha, applied
by cuBLAS to the fp32 accumulator before the one rounding to x's dtype. So y = round(g · Σ x·w) is written straight in
bf16: no fp32 buffer and no cast launch, and no rounding the tile-decoding kernel did not also make (it rounded x
to fp16 besides).

Memory: the cache holds at most `max_bytes` (the span plan's `Pieces.dequant_bytes`, counted by
gpu_worker/prefill.py's span model); a weight that does not fit beside the others evicts the least recently used
(a Mamba layer whose in_proj and out_proj do not fit together is then decoded once per piece), and one larger than
the whole bound is decoded per call in row slices within it (y's column slices written in place by cuBLAS) where
MAX_SLICES allows (1 by measurement: else today's kernel). Only the weights named when the scope opens are cached —
a layer's own projections, which every piece reuses — never e.g. routed experts that pass through `linear`.
Spans of fewer than DEQUANT_MIN_ROWS rows keep the tile-decoding kernel: at 128 rows in one piece the two tie
(bench/kernels/dense_prefill.py), below the decode costs more than it saves.

The NVFP4 decode is the expert prefill's `_dequant_kernel` (one launch, LAYOUT 0 = the checkpoint's row-major
weight); FP8 is one dtype conversion. Twin: `decode_nvfp4` / a dtype conversion in torch (CPU).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from contextlib import contextmanager

import torch

from kernels import backend
from kernels.env import env_count
from kernels.nvfp4 import decode_nvfp4

# rows of a span from which a layer's NVFP4/FP8 weights are decoded for cuBLAS (below: the tile-decoding kernel)
DEQUANT_MIN_ROWS = 128
FORMATS = ("nvfp4", "fp8")
# MOESTREAM_DENSE_DEQUANT=0 in the environment: nothing decoded, the tile-decoding kernels everywhere (an A/B;
# bench/dense_prefill_ab.py flips it between runs of one process)
ENABLED = os.environ.get("MOESTREAM_DENSE_DEQUANT") != "0"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dequant_nbytes(w, dtype=torch.bfloat16) -> int:
    """Bytes of w decoded to `dtype` (what the cache holds for it)."""
    return w.out_features * w.in_features * torch.empty((), dtype=dtype).element_size()


_address_tables: dict = {}


def _addresses(t: torch.Tensor) -> torch.Tensor:
    """[t's address] as the decode kernel's table, int64 on t's device: made once per address by a fill (no host
    copy, so no wait on the stream). Keyed by the address itself, so a table can never point anywhere else."""
    key = (t.device.type, t.device.index, t.data_ptr())
    a = _address_tables.get(key)
    if a is None:
        a = _address_tables[key] = torch.full((1,), t.data_ptr(), dtype=torch.int64, device=t.device)
    return a


def dequantize_unscaled(w, dtype, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """w's values without the global scale, [out, in] in `dtype` (rows [n0, n1) only, if given): NVFP4 e2m1 · e4m3,
    FP8 e4m3 (exact in bf16/fp16)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dequantize to {dtype}: one of {_DTYPES}")
    n0, n1 = rows or (0, w.out_features)
    if not 0 <= n0 < n1 <= w.out_features:
        raise ValueError(f"rows [{n0}, {n1}) of a weight of {w.out_features}")
    if w.fmt == "fp8":
        e4 = w.weight if w.weight.dtype == torch.float8_e4m3fn else w.weight.view(torch.float8_e4m3fn)
        return e4[n0:n1].to(dtype)
    if w.fmt != "nvfp4":
        raise ValueError(f"dequantize_unscaled: {w.fmt!r} weight (only {FORMATS} are decoded)")
    if not backend.use_triton(w.weight, "dense_prefill"):
        return decode_nvfp4(w.weight[n0:n1], w.weight_scale[n0:n1], 1.0, dtype)
    import triton

    from kernels.expert_prefill import DEQUANT_BLOCK, _dequant_kernel
    N, K = n1 - n0, w.in_features
    v, s = w.weight, w.weight_scale
    assert v.is_contiguous() and s.is_contiguous() and v.shape == (w.out_features, K // 2)
    out = torch.empty((N, K), dtype=torch.float16 if dtype == torch.float16 else torch.bfloat16, device=v.device)
    bn, bk = DEQUANT_BLOCK["BLOCK_N"], DEQUANT_BLOCK["BLOCK_K"]
    # the kernel reads a block at an address plus two offsets: here the values' own address and the offsets of
    # row n0's values and of its scales (a second allocation, the same address space) from it
    _dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk), 1)](
        _addresses(v), n0 * (K // 2), s.data_ptr() - v.data_ptr() + n0 * (K // 16) * s.element_size(), out, N, K,
        LAYOUT=0, OUT_BF16=out.dtype == torch.bfloat16, BLOCK_N=bn, BLOCK_K=bk, num_warps=DEQUANT_BLOCK["num_warps"])
    return out if out.dtype == dtype else out.to(dtype)


def linear_dequantized(x2: torch.Tensor, wd: torch.Tensor, scale: float, out: torch.Tensor | None = None):
    """y [M, N] = scale · x2 [M, K] @ wd.T in x2's dtype, scale applied to the fp32 accumulator (alpha). `out`: a
    [M, N] view to write (rows of stride >= N, e.g. a column slice of a wider y)."""
    y = torch.empty((x2.shape[0], wd.shape[0]), dtype=x2.dtype, device=x2.device) if out is None else out
    return y.addmm_(x2, wd.t(), beta=0, alpha=scale)


SLICE_ALIGN = 64    # rows of a weight slice: a multiple of the decode's BLOCK_N and of cuBLAS' tiles
# the most slices a call decodes a weight in; beyond, the tile-decoding kernel. 1: a weight is decoded per call only
# whole. On the H200 4 slices of a 512-row piece ran no faster than the tile kernel (in_proj 129 vs 128 TFLOP/s) and
# slower on the smaller shapes, one launch pair per slice costing host time (bench/NOTES.md, h22)
MAX_SLICES = 1


def max_slices() -> int:
    """The most slices a call decodes a weight in: MOESTREAM_DENSE_SLICES (a whole number, 1 or more), else MAX_SLICES.
    Read per call, so one process can A/B it (bench.prefill's --budget-env arms)."""
    return env_count("MOESTREAM_DENSE_SLICES", MAX_SLICES, "slices")


class DequantCache:
    """A layer's decoded weights, at most `max_bytes`, least recently used evicted first. A weight that cannot be
    held is decoded per call in row slices of at most `max_bytes` (`linear`); `dequantized` counts the decodes
    of whole weights, `sliced` the calls that decoded slices (the tests' evidence of once per weight per span)."""

    def __init__(self, weights, max_bytes: int, rows: int = 0, transient=()):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}: must be >= 0")
        self.max_bytes, self.rows = max_bytes, rows
        self._eligible = {id(w): w for w in [*weights, *transient] if getattr(w, "fmt", None) in FORMATS}
        self._transient = {id(w) for w in transient}
        self._held: OrderedDict = OrderedDict()
        self.bytes = 0
        self.peak_bytes = 0
        self.dequantized = 0
        self.sliced = 0

    def takes(self, w) -> bool:
        return id(w) in self._eligible

    def weight(self, w, dtype) -> torch.Tensor | None:
        """w decoded to `dtype` (without its global scale), or None where this cache does not hold it."""
        if id(w) not in self._eligible or id(w) in self._transient or self.rows < DEQUANT_MIN_ROWS:
            return None
        key = (id(w), dtype)
        t = self._held.get(key)
        if t is not None:
            self._held.move_to_end(key)
            return t
        nb = dequant_nbytes(w, dtype)
        if nb > self.max_bytes:
            return None
        self._make_room(nb)
        t = dequantize_unscaled(w, dtype)
        self.dequantized += 1
        self._held[key] = t
        self.bytes += nb
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return t

    def _make_room(self, nb: int) -> None:
        while self._held and self.bytes + nb > self.max_bytes:
            _, old = self._held.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def linear(self, x2: torch.Tensor, w) -> torch.Tensor | None:
        """y = x2 @ W.T through W's decoded copy (held, or decoded per call in at most `max_slices()` row slices), or
        None: not this cache's weight, too few rows, or the weight takes more slices than that within the bound."""
        if id(w) not in self._eligible or self.rows < DEQUANT_MIN_ROWS:
            return None
        wd = self.weight(w, x2.dtype)
        if wd is not None:
            return linear_dequantized(x2, wd, w.global_host())
        if x2.shape[0] < DEQUANT_MIN_ROWS:      # each call pays the decode here: only where it pays off
            return None
        row_bytes = dequant_nbytes(w, x2.dtype) // w.out_features
        most = max_slices()

        def fits(room: int) -> bool:
            step = room // row_bytes // SLICE_ALIGN * SLICE_ALIGN
            return step >= w.out_features or (step >= SLICE_ALIGN and -(-w.out_features // step) <= most)
        if not fits(self.max_bytes):            # not even the whole bound would do: the held weights stay
            return None
        if (self.max_bytes - self.bytes) // row_bytes < max(SLICE_ALIGN, w.out_features // 4) or \
                not fits(self.max_bytes - self.bytes):
            self._make_room(self.max_bytes)     # too little beside the held weights: drop them for the slices
        step = (self.max_bytes - self.bytes) // row_bytes // SLICE_ALIGN * SLICE_ALIGN
        y = torch.empty((x2.shape[0], w.out_features), dtype=x2.dtype, device=x2.device)
        g = w.global_host()
        for n0 in range(0, w.out_features, step):
            n1 = min(w.out_features, n0 + step)
            # one slice alive at a time: the next one's allocation reuses this one's memory (stream order)
            linear_dequantized(x2, dequantize_unscaled(w, x2.dtype, (n0, n1)), g, out=y[:, n0:n1])
        self.sliced += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes + min(step, w.out_features) * row_bytes)
        return y

    def clear(self) -> None:
        self._held.clear()
        self.bytes = 0


_local = threading.local()


def active() -> DequantCache | None:
    """The cache of the layer this thread is running, if any."""
    return getattr(_local, "cache", None)


@contextmanager
def held(weights, max_bytes: int, rows: int, transient=()):
    """Within: `kernels.linear.linear` multiplies `weights` (a layer's own) through their decoded copies, for a
    span of `rows` rows; on exit they are freed. `transient` weights are decoded per call and never held (an MoE
    layer's fc1, used before its routed experts: nothing of it stays beside their launches)."""
    prev = active()
    cache = _local.cache = DequantCache(weights, max_bytes if ENABLED else 0, rows, transient)
    try:
        yield cache
    finally:
        cache.clear()
        _local.cache = prev

