"""The GEMV inner loops that lost (bench/kernels/gemv_nvfp4_modes.py) still compute the product: their timings
in bench/NOTES.md stay comparable only while they do."""
import pytest
import torch

from bench.kernels.gemv_nvfp4_modes import nvfp4_linear_mode
from kernels.gemv_nvfp4 import nvfp4_linear_torch
from kernels.nvfp4 import encode_nvfp4, swap_nibbles
from kernels.testing import assert_close, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


SHAPES = [(1, 37, 272), (3, 50, 96), (5, 19, 48)]


@pytest.mark.parametrize("M,N,K,mode", [(*s, m) for s in SHAPES for m in (0, 1, 2)] + [(*SHAPES[0], 5)])
def test_lost_mode_matches_twin(M, N, K, mode):     # mode 5 takes one row of x
    q, s, gs = (t.to(DEVICE) for t in encode_nvfp4(torch.randn(N, K) * torch.rand(N, 1)))
    x = torch.randn(M, K, device=DEVICE).bfloat16()
    ref = nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    # mode 5 carries x in three e4m3 parts: ~12 bits
    assert_close(nvfp4_linear_mode(x, q, s, gs, mode), ref, 1e-4 if mode == 5 else 2e-5, f"mode {mode}")
    assert rel_err(nvfp4_linear_mode(x, swap_nibbles(q), s, gs, mode), ref) > 0.1     # must-fail twin
