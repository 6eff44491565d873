"""Dense NVFP4 / FP8 linears: Triton kernels against their twins (and the twins against decode_nvfp4)."""
import pytest
import torch

from kernels.nvfp4 import encode_fp8, encode_nvfp4, swap_nibbles
from kernels import gemv_nvfp4 as g
from kernels.testing import assert_close, rel_err

TOL = 2e-5  # fp32 accumulation; x is exact in fp16 after the 2^-8 prescale at these magnitudes


def _weight(N, K, device):
    w = torch.randn(N, K) * torch.rand(N, 1)  # rows of different magnitudes exercise the scales
    q, s, gs = encode_nvfp4(w)
    return q.to(device), s.to(device), gs.to(device)


def _poisoned(M, N, device):
    return torch.full((M, N), float("nan"), dtype=torch.float32, device=device)


@pytest.mark.parametrize("M,N,K", [(1, 37, 272), (3, 50, 96), (8, 24, 512), (5, 19, 48)])
@pytest.mark.parametrize("load_mode", [3, 4])
def test_nvfp4_gemv_matches_twin(M, N, K, load_mode, device):
    q, s, gs = _weight(N, K, device)
    x = torch.randn(M, K, device=device).bfloat16()
    out = _poisoned(M, N, device)
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=dict(LOAD_MODE=load_mode, SPLIT_K=1), out=out)
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, "gemv")


def test_lost_modes_are_refused(device):
    q, s, gs = _weight(16, 64, device)
    with pytest.raises(ValueError, match="LOAD_MODE 0"):
        g.nvfp4_linear(torch.randn(1, 64, device=device), q, s, gs, config=dict(LOAD_MODE=0))


def test_nvfp4_gemv_split_k(device):
    M, N, K = 2, 21, 1024
    q, s, gs = _weight(N, K, device)
    x = torch.randn(M, K, device=device).bfloat16()
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=dict(SPLIT_K=3, BLOCK_N=16))
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, "split-k")


def test_nvfp4_gemv_fp32_input(device):
    # fp32 x enters the tensor cores as fp16 (11-bit significand): about 2^-12 relative per element
    q, s, gs = _weight(30, 160, device)
    x = torch.randn(2, 160, device=device)
    assert_close(g.nvfp4_linear(x, q, s, gs), g.nvfp4_linear_torch(x, q, s, gs), 1e-3, "fp32 x")


@pytest.mark.parametrize("M,N,K", [(13, 33, 80), (70, 150, 208)])
def test_nvfp4_gemm_prefill_matches_twin(M, N, K, device):
    q, s, gs = _weight(N, K, device)
    x = torch.randn(M, K, device=device).bfloat16()
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device),
                       config=dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32))
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, "gemm")


def test_output_shape_and_dtype(device):
    q, s, gs = _weight(24, 64, device)
    x = torch.randn(2, 1, 64, device=device).bfloat16()
    y = g.nvfp4_linear(x, q, s, gs)
    assert y.shape == (2, 1, 24) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("M,N,K", [(1, 37, 144), (6, 20, 272), (21, 45, 96)])
def test_fp8_linear_matches_twin(M, N, K, device):
    w = torch.randn(N, K)
    f, sc = encode_fp8(w)
    f, sc = f.to(device), sc.to(device)
    x = torch.randn(M, K, device=device).bfloat16()
    y = g.fp8_linear(x, f, sc, out_dtype=torch.float32, out=_poisoned(M, N, device))
    assert_close(y, g.fp8_linear_torch(x, f, sc, out_dtype=torch.float32), TOL, "fp8")


def test_twin_matches_float_reference():
    w = torch.randn(29, 64)
    q, s, gs = encode_nvfp4(w)
    x = torch.randn(3, 64)
    # quantisation error of NVFP4 is a few percent; the twin must be near the float product, not exact
    assert rel_err(g.nvfp4_linear_torch(x, q, s, gs), x @ w.t()) < 0.15


def test_must_fail_swapped_nibbles(device):
    q, s, gs = _weight(40, 256, device)
    x = torch.randn(1, 256, device=device)
    ref = g.nvfp4_linear_torch(x, q, s, gs)
    assert rel_err(g.nvfp4_linear(x, swap_nibbles(q), s, gs), ref) > 0.1


def test_must_fail_wrong_scale_group(device):
    q, s, gs = _weight(40, 256, device)
    x = torch.randn(1, 256, device=device)
    ref = g.nvfp4_linear_torch(x, q, s, gs)
    s_shifted = torch.roll(s.view(torch.uint8), 1, dims=1).view(torch.float8_e4m3fn)
    assert rel_err(g.nvfp4_linear(x, q, s_shifted, gs), ref) > 0.1
