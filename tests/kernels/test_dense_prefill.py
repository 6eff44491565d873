"""kernels.dense_prefill: a layer's NVFP4/FP8 projections decoded once per span and multiplied by cuBLAS.

The decoded path equals the fp32 twin (held, sliced, the Triton decode under the interpreter and its torch twin);
the cache decodes each held weight once per span whatever the pieces, frees it on leaving the layer, stays within
its bound, and leaves decode-sized calls alone. Each check has a must-fail twin."""
from __future__ import annotations

import pytest
import torch

from kernels import backend, dense_prefill
from kernels.dense_prefill import DEQUANT_MIN_ROWS, DequantCache, dequant_nbytes, held
from kernels.gemv_nvfp4 import fp8_linear_torch, nvfp4_linear_torch
from kernels.linear import QuantizedWeight, linear
from kernels.nvfp4 import encode_fp8, encode_nvfp4
from kernels.testing import assert_close, rel_err

N, K, M = 200, 80, 150          # N not a multiple of the decode's 64-row tiles, K of its 128 columns


def _weight(fmt, n=N, k=K, device="cpu"):
    w = torch.randn(n, k) * (torch.rand(n, 1) + 0.1)
    qw = QuantizedWeight(fmt, *(encode_nvfp4(w) if fmt == "nvfp4" else encode_fp8(w)))
    return qw.to(device)


def _twin(x, qw):
    if qw.fmt == "nvfp4":
        return nvfp4_linear_torch(x, qw.weight, qw.weight_scale, qw.weight_scale_2, torch.float32)
    return fp8_linear_torch(x, qw.weight, qw.weight_scale, torch.float32)


def _tol(dtype):
    return 4e-3 if dtype == torch.bfloat16 else 1e-5     # bf16: the output's own rounding (~1e-3)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("decode", ["triton", "twin"])
def test_held_path_equals_fp32_twin(fmt, dtype, decode, device, monkeypatch):
    monkeypatch.setattr(backend, "FORCED", {"dense_prefill": decode})
    qw = _weight(fmt, device=device)
    x = torch.randn(M, K, device=device).to(dtype)
    with held([qw], 1 << 30, M) as cache:
        y = linear(x, qw)
        assert cache.dequantized == 1 and cache.bytes == dequant_nbytes(qw, dtype)
    assert y.dtype == dtype and y.shape == (M, N)
    assert_close(y, _twin(x, qw), _tol(dtype), f"{fmt} {dtype} {decode}")


def test_decode_is_exact_and_triton_equals_twin(device, monkeypatch):
    """The decoded values are e2m1 · e4m3 exactly, in bf16 as in fp32; Triton's decode equals the torch twin bit for
    bit, a row slice too."""
    qw = _weight("nvfp4", device=device)
    ref = dense_prefill.decode_nvfp4(qw.weight, qw.weight_scale, 1.0, torch.float32)
    monkeypatch.setattr(backend, "FORCED", {"dense_prefill": "triton"})
    tri = dense_prefill.dequantize_unscaled(qw, torch.bfloat16)
    part = dense_prefill.dequantize_unscaled(qw, torch.bfloat16, (70, 133))
    assert torch.equal(tri.float(), ref) and torch.equal(part.float(), ref[70:133])
    monkeypatch.setattr(backend, "FORCED", {"dense_prefill": "twin"})
    assert torch.equal(dense_prefill.dequantize_unscaled(qw, torch.bfloat16, (70, 133)).float(), ref[70:133])


def test_must_fail_scale_left_out_is_caught(device):
    """Must-fail twin: the global scale left out of alpha (the decoded weight is unscaled) is caught."""
    qw = _weight("nvfp4", device=device)
    x = torch.randn(M, K, device=device).bfloat16()
    with held([qw], 1 << 30, M) as cache:
        bad = dense_prefill.linear_dequantized(x, cache.weight(qw, x.dtype), 1.0)
    assert rel_err(bad, _twin(x, qw)) > 100 * _tol(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_sliced_equals_twin_within_its_bound(fmt, device, monkeypatch):
    """A bound below the weight: decoded per call in row slices (y's column slices written in place), each slice
    within the bound; the twin shifts each slice's rows by one and is caught."""
    monkeypatch.setattr(dense_prefill, "MAX_SLICES", 4)
    qw = _weight(fmt, device=device)
    x = torch.randn(M, K, device=device).bfloat16()
    bound = dequant_nbytes(qw) // 3
    with held([qw], bound, M) as cache:
        y = linear(x, qw)
        assert cache.sliced == 1 and cache.dequantized == 0 and 0 < cache.peak_bytes <= bound
    assert_close(y, _twin(x, qw), _tol(torch.bfloat16), f"{fmt} sliced")
    right = dense_prefill.dequantize_unscaled

    def shifted(w, dtype, rows=None):
        n0, n1 = rows
        return right(w, dtype, (n0 + 1, n1 + 1) if n1 < w.out_features else (n0, n1))
    monkeypatch.setattr(dense_prefill, "dequantize_unscaled", shifted)
    with held([qw], bound, M):
        bad = linear(x, qw)
    assert rel_err(bad, _twin(x, qw)) > 0.1


class _Counting:
    """Every decode of a whole weight (rows None) and of a slice, by weight."""

    def __init__(self, monkeypatch):
        self.whole, self.slices = [], []
        right = dense_prefill.dequantize_unscaled

        def count(w, dtype, rows=None):
            (self.whole if rows is None else self.slices).append(id(w))
            return right(w, dtype, rows)
        monkeypatch.setattr(dense_prefill, "dequantize_unscaled", count)


def _pieces_of_a_layer(x, a, b, piece):
    """Two weights used alternately piece by piece, as a Mamba layer's in_proj and out_proj are."""
    out = []
    for p in range(0, x.shape[0], piece):
        h = linear(x[p:p + piece], a)
        out.append(linear(h[:, :b.in_features], b))
    return torch.cat(out)


def once_per_weight(count: _Counting, weights) -> bool:
    return sorted(count.whole) == sorted(id(w) for w in weights) and not count.slices


def test_each_weight_decoded_once_per_span_and_freed(device, monkeypatch):
    a, b = _weight("nvfp4", 96, 64, device), _weight("fp8", 48, 96, device)
    x = torch.randn(700, 64, device=device).bfloat16()
    count = _Counting(monkeypatch)
    with held([a, b], 1 << 30, 700) as cache:
        y = _pieces_of_a_layer(x, a, b, 128)
        assert cache.bytes == dequant_nbytes(a) + dequant_nbytes(b) == cache.peak_bytes
    assert once_per_weight(count, [a, b]), "each weight decoded once for the span's 6 pieces"
    assert cache.bytes == 0 and not cache._held and dense_prefill.active() is None
    ref = _pieces_of_a_layer(x.float(), a, b, 128)      # no scope: the twin path, fp32
    assert_close(y, ref, 2e-2, "pieces")


def test_must_fail_decoding_per_piece_is_caught(device, monkeypatch):
    """Must-fail twin: a cache that forgets its weights between calls decodes them once per piece; the count says
    so."""
    a, b = _weight("nvfp4", 96, 64, device), _weight("fp8", 48, 96, device)
    x = torch.randn(700, 64, device=device).bfloat16()
    count = _Counting(monkeypatch)
    right = DequantCache.weight

    def forgetful(self, w, dtype):
        self.clear()
        return right(self, w, dtype)
    monkeypatch.setattr(DequantCache, "weight", forgetful)
    with held([a, b], 1 << 30, 700):
        _pieces_of_a_layer(x, a, b, 128)
    assert not once_per_weight(count, [a, b]) and len(count.whole) == 12


def test_a_bound_for_one_weight_evicts_and_stays_within(device, monkeypatch):
    """A bound that holds either weight but not both: each piece decodes both again (LRU eviction), never more than
    the bound held."""
    a, b = _weight("nvfp4", 96, 64, device), _weight("nvfp4", 64, 96, device)
    x = torch.randn(300, 64, device=device).bfloat16()
    count = _Counting(monkeypatch)
    bound = max(dequant_nbytes(a), dequant_nbytes(b))
    with held([a, b], bound, 300) as cache:
        _pieces_of_a_layer(x, a, b, 128)
    assert len(count.whole) == 6 and cache.peak_bytes <= bound


def test_transient_weights_are_never_held(device, monkeypatch):
    """An MoE layer's fc1: decoded per call (one slice, the whole weight), nothing left held between calls."""
    a = _weight("nvfp4", 96, 64, device)
    x = torch.randn(384, 64, device=device).bfloat16()
    count = _Counting(monkeypatch)
    with held([], 1 << 30, 384, transient=[a]) as cache:
        for p in range(0, 384, 128):
            linear(x[p:p + 128], a)
            assert cache.bytes == 0
    assert not count.whole and len(count.slices) == 3


def test_decode_rows_and_outside_a_scope_are_unchanged(device, monkeypatch):
    """Calls of <= DECODE_MAX_ROWS rows (decode), spans shorter than DEQUANT_MIN_ROWS, weights the scope was not
    given and calls outside any scope never decode."""
    a, other = _weight("nvfp4", 96, 64, device), _weight("nvfp4", 96, 64, device)
    count = _Counting(monkeypatch)
    x = torch.randn(DEQUANT_MIN_ROWS, 64, device=device)
    with held([a], 1 << 30, DEQUANT_MIN_ROWS):
        linear(x[:8], a)
        linear(x, other)
    with held([a], 1 << 30, DEQUANT_MIN_ROWS - 1):
        linear(x[:-1], a)
    linear(x, a)
    assert not count.whole and not count.slices
    with held([a], 1 << 30, DEQUANT_MIN_ROWS):   # the twin: the same span at the threshold decodes
        linear(x, a)
    assert len(count.whole) == 1


def test_bad_bound_and_rows_are_refused():
    qw = _weight("nvfp4")
    with pytest.raises(ValueError, match="max_bytes=-1"):
        DequantCache([qw], -1)
    with pytest.raises(ValueError, match=r"rows \[5, 300\) of a weight of 200"):
        dense_prefill.dequantize_unscaled(qw, torch.bfloat16, (5, 300))
    with pytest.raises(ValueError, match="dequantize to torch.int8"):
        dense_prefill.dequantize_unscaled(qw, torch.int8)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_tile_kernels_store_bf16_directly(fmt, device, monkeypatch):
    """Outside a layer (or under DEQUANT_MIN_ROWS rows) the tile-decoding GEMMs run; they now store y in x's dtype
    themselves (no fp32 buffer and cast): bf16 y within the bf16 rounding of the fp32 twin."""
    from kernels import gemv_nvfp4
    monkeypatch.setattr(backend, "FORCED", {"gemv_nvfp4": "triton"})
    qw = _weight(fmt, 72, 96, device)
    x = torch.randn(37, 96, device=device).bfloat16()
    y = linear(x, qw)
    assert y.dtype == torch.bfloat16 and y.shape == (37, 72)
    assert_close(y, _twin(x, qw), 4e-3, f"{fmt} tile kernel, bf16 out")
    # the fp32 output a caller asks for is still fp32 (not rounded through bf16)
    if fmt == "nvfp4":
        y32 = gemv_nvfp4.nvfp4_linear(x, qw.weight, qw.weight_scale, qw.weight_scale_2, out_dtype=torch.float32)
    else:
        y32 = gemv_nvfp4.fp8_linear(x, qw.weight, qw.weight_scale, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and not torch.equal(y32, y32.bfloat16().float())


def test_more_slices_than_allowed_keep_the_tile_kernel(device, monkeypatch):
    """With MAX_SLICES 1 (the default) a weight larger than the bound is not decoded at all; the twin, 4 slices
    allowed, decodes it."""
    qw = _weight("nvfp4", device=device)
    x = torch.randn(M, K, device=device).bfloat16()
    count = _Counting(monkeypatch)
    with held([qw], dequant_nbytes(qw) // 3, M) as cache:
        y = linear(x, qw)
        assert cache.sliced == 0 and not count.slices and not count.whole
    assert_close(y, _twin(x, qw), _tol(torch.bfloat16), "tile kernel")
    monkeypatch.setattr(dense_prefill, "MAX_SLICES", 4)
    with held([qw], dequant_nbytes(qw) // 3, M):
        linear(x, qw)
    assert len(count.slices) == 4


def test_a_weight_that_cannot_be_decoded_evicts_nothing(device, monkeypatch):
    """A weight beyond the bound that keeps the tile kernel (MAX_SLICES 1) leaves the held ones held: a Mamba layer
    whose in_proj does not fit keeps its out_proj decoded across the pieces. The twin, slices allowed, drops it."""
    big, small = _weight("nvfp4", 256, 64, device), _weight("nvfp4", 64, 128, device)
    x = torch.randn(300, 64, device=device).bfloat16()
    count = _Counting(monkeypatch)
    bound = dequant_nbytes(big) * 2 // 3
    with held([big, small], bound, 300):
        _pieces_of_a_layer(x, big, small, 128)
    assert count.whole == [id(small)] and not count.slices, "out_proj decoded once, in_proj never"
    count.whole.clear()
    monkeypatch.setattr(dense_prefill, "MAX_SLICES", 4)
    with held([big, small], bound, 300):
        _pieces_of_a_layer(x, big, small, 128)
    assert len(count.whole) == 2 and count.slices, "with slices, in_proj evicts out_proj in each full piece"


def test_the_slices_switch_is_read_per_call(device, monkeypatch):
    """MOESTREAM_DENSE_SLICES sets the most slices a call decodes in, read per call (bench.prefill's arms A/B it in one
    engine): 4 decodes the weight beyond the bound in 4 slices and equals the twin; unset, the tile kernel (the
    must-fail side: no slices); a bad value names the variable."""
    qw = _weight("nvfp4", device=device)
    x = torch.randn(M, K, device=device).bfloat16()
    count = _Counting(monkeypatch)
    monkeypatch.setenv("MOESTREAM_DENSE_SLICES", "4")
    with held([qw], dequant_nbytes(qw) // 3, M):
        y = linear(x, qw)
    assert len(count.slices) == 4
    assert_close(y, _twin(x, qw), _tol(torch.bfloat16), "4 slices by the switch")
    count.slices.clear()
    monkeypatch.delenv("MOESTREAM_DENSE_SLICES")
    with held([qw], dequant_nbytes(qw) // 3, M):
        linear(x, qw)
    assert not count.slices
    for bad in ("0", "two"):
        monkeypatch.setenv("MOESTREAM_DENSE_SLICES", bad)
        with held([qw], dequant_nbytes(qw) // 3, M), pytest.raises(ValueError, match="MOESTREAM_DENSE_SLICES"):
            linear(x, qw)
