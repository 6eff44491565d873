"""Dense NVFP4 / FP8 linears: Triton kernels against their twins (and the twins against decode_nvfp4)."""
import math

import pytest
import torch

from kernels.nvfp4 import encode_fp8, encode_nvfp4, swap_nibbles
from kernels import gemv_nvfp4 as g
from kernels.testing import assert_close, fp16_value, rel_err, run_ptx

TOL = 2e-5  # fp32 accumulation; x is exact in fp16 after the 2^-8 prescale at these magnitudes


def _weight(N, K, device):
    w = torch.randn(N, K) * torch.rand(N, 1)  # rows of different magnitudes exercise the scales
    q, s, gs = encode_nvfp4(w)
    return q.to(device), s.to(device), gs.to(device)


def _poisoned(M, N, device):
    return torch.full((M, N), float("nan"), dtype=torch.float32, device=device)


SHAPES = [(1, 37, 272), (3, 50, 96), (8, 24, 512), (5, 19, 48)]


@pytest.mark.parametrize("M,N,K,load_mode", [(*s, m) for s in SHAPES for m in g.DECODE_MODES if m != 8 or s[0] <= 4])
def test_nvfp4_gemv_matches_twin(M, N, K, load_mode, device):   # mode 8 takes up to 4 rows
    q, s, gs = _weight(N, K, device)
    x = torch.randn(M, K, device=device).bfloat16()
    out = _poisoned(M, N, device)
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=dict(LOAD_MODE=load_mode, SPLIT_K=1), out=out)
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, "gemv")


def test_lost_modes_are_refused(device):
    q, s, gs = _weight(16, 64, device)
    with pytest.raises(ValueError, match="LOAD_MODE 0"):
        g.nvfp4_linear(torch.randn(1, 64, device=device), q, s, gs, config=dict(LOAD_MODE=0))


@pytest.mark.parametrize("M,N,K,mode", [(1, 37, 272, 8), (3, 50, 96, 8), (3, 50, 96, 9), (8, 24, 512, 9), (5, 19, 48, 9)])
def test_nvfp4_gemv_x_gathered_in_the_kernel(M, N, K, mode, device):
    """Modes 8/9 with B gathered per tile from x (X_INLINE) instead of prepared by a second launch."""
    q, s, gs = _weight(N, K, device)
    x = torch.randn(M, K, device=device).bfloat16()
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device),
                       config=dict(LOAD_MODE=mode, SPLIT_K=1, X_INLINE=True))
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, "gemv x inline")


@pytest.mark.parametrize("load_mode", g.DECODE_MODES)
def test_nvfp4_gemv_split_k(load_mode, device):
    M, N, K = 2, 21, 1024
    q, s, gs = _weight(N, K, device)
    x = torch.randn(M, K, device=device).bfloat16()
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=dict(SPLIT_K=3, BLOCK_N=16, LOAD_MODE=load_mode))
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, "split-k")


@pytest.mark.parametrize("mode", [8, 9])
def test_prepared_x_operands_layout(mode, device):
    """The B operands of modes 8/9, checked element by element against their definition."""
    M, K = 3, 64
    x = torch.randn(M, K, device=device)
    m_pad = 4
    xb = g.x_operands(x, m_pad, mode == 8).float().cpu() * 256
    G = 16 // m_pad
    for J in range(4):
        for i in range(K // 4):
            for c in range(16):
                m = c // G
                on = m < M and ((c % G == (i // 4) % G) if mode == 8 else c % G == 0)
                want = float((x[m, 4 * i + J] / 256).half()) * 256 if on else 0.0   # fp16 of x · 2^-8
                assert xb[J, i, c] == want, (J, i, c)


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


class _Launches:
    """Stands in for `_nvfp4_gemm_kernel`: records each launch's grid and configuration, then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*a, **kw):
            self.calls.append((grid, {k: kw[k] for k in g.GEMM_KEYS if k in kw}))
            return self.kernel[grid](*a, **kw)
        return launch


def test_the_gemm_configuration_switch(device, monkeypatch):
    """MOESTREAM_NVFP4_GEMM sets the tile-decoding GEMM's configuration per call over GEMM_CONFIG: the launch takes it
    (its grid follows BLOCK_M / BLOCK_N) and the result equals the twin on odd shapes; unset, GEMM_CONFIG (the
    must-fail side of the launch check); a caller's config still decides over it; a bad entry names the variable."""
    M, N, K = 70, 150, 208
    q, s, gs = _weight(N, K, device)
    x = torch.randn(M, K, device=device).bfloat16()
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    rec = _Launches(g._nvfp4_gemm_kernel)
    monkeypatch.setattr(g, "_nvfp4_gemm_kernel", rec)
    monkeypatch.setenv("MOESTREAM_NVFP4_GEMM", "BLOCK_M=32,BLOCK_N=32:BLOCK_K=32,num_warps=4")
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device))
    assert_close(y, ref, TOL, "gemm by the switch")
    assert rec.calls[-1] == ((5, 3), dict(g.GEMM_CONFIG, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4))
    monkeypatch.delenv("MOESTREAM_NVFP4_GEMM")
    g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32)
    assert rec.calls[-1][1] == g.GEMM_CONFIG and rec.calls[-1][0] == (-(-N // g.GEMM_CONFIG["BLOCK_N"]),
                                                                        -(-M // g.GEMM_CONFIG["BLOCK_M"]))
    monkeypatch.setenv("MOESTREAM_NVFP4_GEMM", "BLOCK_M=32")
    g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32))
    assert rec.calls[-1][1]["BLOCK_M"] == 16
    for bad in ("BLOCK_Q=2", "BLOCK_M=0", "BLOCK_M", "num_warps=four"):
        monkeypatch.setenv("MOESTREAM_NVFP4_GEMM", bad)
        with pytest.raises(ValueError, match="MOESTREAM_NVFP4_GEMM"):
            g.nvfp4_linear(x, q, s, gs)


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
    if M <= g.DECODE_MAX_ROWS:   # the decode kernel, split along K too
        y = g.fp8_linear(x, f, sc, out_dtype=torch.float32, config=dict(SPLIT_K=2, BLOCK_K=64))
        assert_close(y, g.fp8_linear_torch(x, f, sc, out_dtype=torch.float32), TOL, "fp8 split")


def test_twin_matches_float_reference():
    w = torch.randn(29, 64)
    q, s, gs = encode_nvfp4(w)
    x = torch.randn(3, 64)
    # quantisation error of NVFP4 is a few percent; the twin must be near the float product, not exact
    assert rel_err(g.nvfp4_linear_torch(x, q, s, gs), x @ w.t()) < 0.15


@pytest.mark.parametrize("load_mode", g.DECODE_MODES)
def test_must_fail_swapped_nibbles(load_mode, device):
    q, s, gs = _weight(40, 256, device)
    x = torch.randn(1, 256, device=device)
    ref = g.nvfp4_linear_torch(x, q, s, gs)
    cfg = dict(LOAD_MODE=load_mode)
    assert rel_err(g.nvfp4_linear(x, swap_nibbles(q), s, gs, config=cfg), ref) > 0.1
    assert rel_err(g.nvfp4_linear(x, q, s, gs, config=cfg), ref) < 1e-3      # fp32 x enters as fp16


@pytest.mark.parametrize("load_mode", g.DECODE_MODES)
def test_must_fail_wrong_scale_group(load_mode, device):
    q, s, gs = _weight(40, 256, device)
    x = torch.randn(1, 256, device=device)
    ref = g.nvfp4_linear_torch(x, q, s, gs)
    s_shifted = torch.roll(s.view(torch.uint8), 1, dims=1).view(torch.float8_e4m3fn)
    assert rel_err(g.nvfp4_linear(x, q, s_shifted, gs, config=dict(LOAD_MODE=load_mode)), ref) > 0.1


# ---- the inline-PTX decode, run on a Python model of the PTX instructions it uses -----------------------------
# (the interpreter cannot run inline assembly; on a GPU the kernels' own tests above run it)

@pytest.mark.parametrize("J", [0, 1, 2, 3])
def test_quad_asm_decodes_every_int16_code(J):
    from kernels.nvfp4 import E2M1_VALUES
    asm = [g._QUAD_ASM0, g._QUAD_ASM1, g._QUAD_ASM2, g._QUAD_ASM3][J].value
    gen = torch.Generator().manual_seed(2 + J)
    for lane in range(2):
        for c in range(16):
            h = torch.randint(0, 1 << 16, (2,), generator=gen).tolist()
            h[lane] = (h[lane] & ~(15 << 4 * J)) | (c << 4 * J)
            (out,) = run_ptx(asm, [h[0] | (h[1] << 16)])
            for i in range(2):
                code = (h[i] >> 4 * J) & 15
                got = fp16_value((out >> 16 * i) & 0xFFFF) * 2.0 ** 14
                want = E2M1_VALUES[code]
                assert got == want and math.copysign(1, got) == math.copysign(1, want), (J, lane, c, i, hex(out))


def test_must_fail_model_catches_a_wrong_sign_shift():
    """The model is not vacuous: the quad decode with the sign taken 4 bits off is caught."""
    bad = g._QUAD_ASM1.value.replace("shl.b32 b, $1, 8", "shl.b32 b, $1, 4")
    (out,) = run_ptx(bad, [0x0080_0080])           # code 8 (-0.0) at J=1 in both lanes -> sign must be set
    assert out & 0x80008000 != 0x80008000
    (out,) = run_ptx(g._QUAD_ASM1.value, [0x0080_0080])
    assert out & 0x80008000 == 0x80008000
