"""The NVFP4/FP8 codec against hand-computed vectors and an independent scalar implementation."""
import math

import pytest
import torch

from kernels.nvfp4 import (E2M1_VALUES, decode_fp8, decode_nvfp4, encode_fp8, encode_nvfp4, pack_codes,
                           swap_nibbles, unpack_codes)

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_byte_to_float(b: int) -> float:
    """Independent e4m3fn decoder: bias 7, no inf, 0x7F/0xFF NaN, subnormals m/8 * 2^-6."""
    s = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return s * (m / 8) * 2.0 ** -6
    return s * (1 + m / 8) * 2.0 ** (e - 7)


def scalar_e2m1_code(q: float) -> int:
    """Nearest e2m1 magnitude, ties to the even code, saturating at 6 — written independently of the codec."""
    mag = abs(q)
    best = min(range(8), key=lambda c: (abs(MAGS[c] - mag), c % 2))
    return best | (8 if q < 0 else 0)


def test_e4m3_decode_matches_hand_decoder():
    raw = torch.arange(256, dtype=torch.uint8)
    vals = raw.view(torch.float8_e4m3fn).float().tolist()
    for b, v in enumerate(vals):
        ref = e4m3_byte_to_float(b)
        assert (math.isnan(v) and math.isnan(ref)) or v == ref, f"byte {b:#x}: {v} != {ref}"
    assert e4m3_byte_to_float(0x7E) == 448.0 and e4m3_byte_to_float(0x38) == 1.0


def test_nibble_order_low_first():
    # byte 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) is element 1
    packed = torch.tensor([[0x21, 0xF9] * 4], dtype=torch.uint8)       # 0xF9: low 9 (-0.5), high F (-6)
    scale = torch.full((1, 1), 2.0).to(torch.float8_e4m3fn)
    w = decode_nvfp4(packed, scale, torch.tensor(0.25))
    assert w[0, :4].tolist() == [0.5 * 0.5, 1.0 * 0.5, -0.5 * 0.5, -6.0 * 0.5]
    codes = unpack_codes(packed)
    assert codes[0, :4].tolist() == [1, 2, 9, 15]
    assert torch.equal(pack_codes(codes), packed)
    # the must-fail twin changes the decoded values
    assert not torch.equal(decode_nvfp4(swap_nibbles(packed), scale, torch.tensor(0.25)), w)


def test_rounding_ties_to_even_and_saturation():
    # one block whose amax is 6 so that with global 1/448 the block scale is exactly 1.0
    g = torch.tensor(2.0 ** -9)  # a power of two keeps w / (scale * g) exact, so ties stay ties
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 0.1, -6.0, 2.9, 4.1, 5.5, -1.6]
    w = torch.tensor([vals]) * float(g)
    packed, scale, g2 = encode_nvfp4(w, weight_scale_2=g)
    assert scale.float().item() == 1.0
    codes = unpack_codes(packed)[0].tolist()
    #        6  .25 .75 1.25 1.75 2.5 3.5  5  -.25 -.75  .1  -6  2.9 4.1 5.5 -1.6
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 0, 15, 5, 6, 7, 11]
    assert codes == [scalar_e2m1_code(v) for v in vals]


def test_encode_matches_independent_scalar_quantizer():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(5, 48, generator=g) * torch.rand(5, 1, generator=g) * 3
    packed, scale, g2 = encode_nvfp4(w)
    assert math.isclose(float(g2), float(w.abs().max()) / (6 * 448), rel_tol=1e-6)
    codes = unpack_codes(packed)
    for r in range(5):
        for b in range(3):
            blk = w[r, 16 * b:16 * b + 16]
            s = torch.tensor(float(blk.abs().max()) / (6 * float(g2))).to(torch.float8_e4m3fn).float().item()
            assert scale[r, b].float().item() == s
            for i in range(16):
                q = float(blk[i]) / (s * float(g2))
                assert int(codes[r, 16 * b + i]) == scalar_e2m1_code(float(torch.tensor(q, dtype=torch.float32))), (r, b, i)


def test_roundtrip_error_bounded_by_block_scale():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(33, 80, generator=g)
    packed, scale, g2 = encode_nvfp4(w)
    d = decode_nvfp4(packed, scale, g2)
    step = (scale.float() * g2).repeat_interleave(16, dim=1)   # one unit of the e2m1 grid at the top is 2*step
    assert ((d - w).abs() <= step * 1.0 + 1e-7).all()
    assert set(torch.unique(unpack_codes(packed)).tolist()) <= set(range(16))
    assert len(E2M1_VALUES) == 16


def test_fp8_roundtrip():
    w = torch.randn(17, 31, generator=torch.Generator().manual_seed(1))
    q, s = encode_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and math.isclose(float(s), float(w.abs().max()) / 448, rel_tol=1e-6)
    d = decode_fp8(q, s)
    assert ((d - w).abs() <= w.abs() * 2 ** -3 + 1e-6).all()


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="scale shape"):
        decode_nvfp4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2).to(torch.float8_e4m3fn), 1.0)
    with pytest.raises(ValueError, match="% 16"):
        encode_nvfp4(torch.randn(2, 24))
