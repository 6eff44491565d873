"""bench/kernels/gemv_fp8_fma.py (session 36's FP8 GEMV on the CUDA cores) against its fp32 twin under Triton's
interpreter: odd row counts, K-slices of unequal length, both x rows, codes over the whole e4m3 range; the twins that
must fail (codes paired with the wrong x, signs flipped, x scaled past the fp16 headroom); the inline-PTX decode on
kernels.testing's model of the PTX against torch's e4m3 for every code. (tests/conftest.py sets the interpreter on a
machine without a GPU; with one, the kernel runs its PTX.)"""
import pytest
import torch

from bench.kernels import gemv_fp8_fma as k
from bench.kernels.gemv_fma_sweep import Fp8Fma
from kernels.gemv_nvfp4 import fp8_linear_torch
from kernels.testing import fp16_value, rel_err, run_ptx

SMALL = dict(R=1, num_warps=2, PPS=1)       # two rows a block: few interpreted programs


def _weights(n, kk, seed):
    """e4m3 codes over the whole range but NaN, and a per-tensor scale."""
    b = torch.randint(0, 256, (n, kk), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.view(torch.float8_e4m3fn), torch.tensor(3e-3)


def _x(m, kk, seed):
    x = torch.randn(m, kk, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 40.0                          # an outlier sets the slice's power of two
    return x.bfloat16()


@pytest.mark.parametrize("m, n, kk, cfg, slices", [
    (1, 7, 528, dict(C=1), 2),               # 33 lane chunks: slices of 17 and 16, the split join
    (2, 5, 1040, dict(C=2), 2),              # both x rows, 65 chunks over two slices
    (1, 9, 272, {}, 1),                      # 17 chunks in one slice: idle lanes in the second chunk
])
def test_fp8_fma_equals_the_twin(m, n, kk, cfg, slices):
    w, sc = _weights(n, kk, seed=n + kk)
    x = _x(m, kk, seed=kk)
    c = {**SMALL, **cfg}
    assert k.fp8_fma_config(m, n, kk, torch.device("cpu"), c)["SLICES"] == slices
    ref = fp8_linear_torch(x, w, sc, out_dtype=torch.float32)
    y = k.fp8_linear_fma(x, w, sc, out_dtype=torch.float32, config=c)
    assert y.shape == (m, n) and rel_err(y, ref) < 2e-3
    # the must-fail twins through the same kernel: each code against its pair neighbour's x; every sign flipped
    swapped = w.view(torch.uint8).view(-1, 2).flip(1).reshape(n, kk).view(torch.float8_e4m3fn)
    assert rel_err(k.fp8_linear_fma(x, swapped, sc, out_dtype=torch.float32, config=c), ref) > 0.1
    flipped = (w.view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)
    assert rel_err(k.fp8_linear_fma(x, flipped, sc, out_dtype=torch.float32, config=c), ref) > 0.1


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # the twin's overflow
def test_fp16_sums_hold_the_largest_codes():
    """Every code 448 and x all at the top of its power of two (1.9921875, scaled to 3.984375): four chunks a lane
    sum to 57,120 in fp16 (< 65,504) and the result is exact; the twin with x scaled one power of two higher
    overflows to inf."""
    n, kk = 3, 2048
    w = torch.full((n, kk), 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn)
    x = torch.full((1, kk), 1.9921875).bfloat16()
    c = dict(SMALL, C=4)
    y = k.fp8_linear_fma(x, w, torch.tensor(1.0), out_dtype=torch.float32, config=c)
    assert torch.equal(y, torch.full((1, n), 448.0 * 1.9921875 * kk))
    bad = k.fp8_linear_fma(x, w, torch.tensor(1.0), out_dtype=torch.float32, config=dict(c, X_TOP=3))
    assert rel_err(bad, y) == float("inf")


def test_config_and_shapes_refused():
    with pytest.raises(ValueError, match="at most 4 chunks"):
        k.fp8_fma_config(1, 8, 4096, torch.device("cpu"), dict(C=8))
    w, sc = _weights(4, 40, seed=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        k.fp8_linear_fma(torch.ones(1, 40).bfloat16(), w, sc)
    w, sc = _weights(4, 64, seed=0)
    with pytest.raises(ValueError, match="1-2 rows"):
        k.fp8_linear_fma(torch.ones(3, 64).bfloat16(), w, sc)


def test_sweep_hooks_draw_no_nan_and_break_the_pairing():
    (w, sc), = Fp8Fma.weights(64, 256, 1, seed=3)
    codes = w.view(torch.uint8)
    assert not torch.isnan(w.float()).any() and int(codes.max()) == 0xFE and int((codes & 0x7F).max()) == 0x7E
    broken, _ = Fp8Fma.broken((w, sc))
    b = broken.view(torch.uint8)
    assert torch.equal(b[:, 0::2], codes[:, 1::2]) and torch.equal(b[:, 1::2], codes[:, 0::2])


def test_decode_ptx_gives_each_code_its_fp16_value_in_place():
    """DECODE_FP8_PTX on the PTX model: word bytes b0..b3 -> pairs (b0 low, b1 high), (b2 low, b3 high), each the
    code's value exactly, for every code in every byte position; the must-fail twin (the halves swapped) differs."""
    codes = [c for c in range(256) if c & 0x7F != 0x7F]
    value = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for i, c in enumerate(codes):
        j = len(codes) - 1 - i
        word = c | (codes[j] << 8) | (codes[(i * 7) % len(codes)] << 16) | (codes[(i * 13) % len(codes)] << 24)
        p0, p1 = run_ptx(k.DECODE_FP8_PTX, [word])
        got = [fp16_value(p0), fp16_value(p0 >> 16), fp16_value(p1), fp16_value(p1 >> 16)]
        assert got == [value[i], value[j], value[(i * 7) % len(codes)], value[(i * 13) % len(codes)]], hex(word)
    twin = k.DECODE_FP8_PTX.replace("mov.b32 {lo, hi}", "mov.b32 {hi, lo}")
    p0, _ = run_ptx(twin, [0x38 | (0x40 << 8)])      # 1.0, 2.0
    assert (fp16_value(p0), fp16_value(p0 >> 16)) != (1.0, 2.0)
