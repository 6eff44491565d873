"""The GEMV inner loops that lost (bench/kernels/gemv_nvfp4_modes.py) still compute the product: their timings
in bench/NOTES.md stay comparable only while they do. Mode 6/7's PTX lookup is checked on the PTX model."""
import math

import pytest
import torch

from bench.kernels import gemv_nvfp4_modes as modes
from bench.kernels.gemv_nvfp4_modes import nvfp4_linear_mode
from kernels.gemv_nvfp4 import nvfp4_linear_torch
from kernels.nvfp4 import encode_nvfp4, swap_nibbles
from kernels.testing import assert_close, fp16_value, rel_err, run_ptx

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


SHAPES = [(1, 37, 272), (3, 50, 96), (5, 19, 48)]


@pytest.mark.parametrize("M,N,K,mode", [(*s, m) for s in SHAPES for m in (0, 1, 2, 3, 4, 6, 7)] + [(*SHAPES[0], 5)])
def test_lost_mode_matches_twin(M, N, K, mode):     # mode 5 takes one row of x
    q, s, gs = (t.to(DEVICE) for t in encode_nvfp4(torch.randn(N, K) * torch.rand(N, 1)))
    x = torch.randn(M, K, device=DEVICE).bfloat16()
    ref = nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    # mode 5 carries x in three e4m3 parts: ~12 bits
    assert_close(nvfp4_linear_mode(x, q, s, gs, mode), ref, 1e-4 if mode == 5 else 2e-5, f"mode {mode}")
    assert rel_err(nvfp4_linear_mode(x, swap_nibbles(q), s, gs, mode), ref) > 0.1     # must-fail twin


def test_lost_modes_split_k():
    q, s, gs = (t.to(DEVICE) for t in encode_nvfp4(torch.randn(21, 1024)))
    x = torch.randn(2, 1024, device=DEVICE).bfloat16()
    ref = nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    for mode in (3, 4):
        assert_close(nvfp4_linear_mode(x, q, s, gs, mode, block_n=16, split_k=3), ref, 2e-5, f"mode {mode} split")


def test_lookup_asm_decodes_every_byte_in_every_position():
    from kernels.nvfp4 import E2M1_VALUES
    gen = torch.Generator().manual_seed(1)
    for pos in range(4):
        for v in range(256):
            bs = torch.randint(0, 256, (4,), generator=gen).tolist()
            bs[pos] = v
            r = sum(b << 8 * i for i, b in enumerate(bs))
            lo01, lo23, hi01, hi23 = run_ptx(modes._E2M1_ASM.value, [r])
            lo = [lo01 & 0xFFFF, lo01 >> 16, lo23 & 0xFFFF, lo23 >> 16]
            hi = [hi01 & 0xFFFF, hi01 >> 16, hi23 & 0xFFFF, hi23 >> 16]
            for i, b in enumerate(bs):
                for bits, code in ((lo[i], b & 15), (hi[i], b >> 4)):
                    want = E2M1_VALUES[code]
                    got = fp16_value(bits)
                    assert got == want and math.copysign(1, got) == math.copysign(1, want), (pos, v, i, code, hex(bits))
