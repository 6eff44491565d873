"""The dense NVFP4 linear through the rega scheme (kernels/linear_rega.py): its Triton twin against the PyTorch
reference on odd shapes (interpreter on a CPU), the Gluon kernel against both (GPU only: Gluon has no interpreter),
the kernel compiled for sm_90 on the CPU, the switch, and `kernels.linear.linear`'s route to it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import linear_rega as LR
from kernels.gemv_nvfp4 import nvfp4_linear_torch
from kernels.linear import QuantizedWeight
from kernels.nvfp4 import encode_nvfp4
from kernels.testing import assert_close, rel_err
from test_expert_prefill_rega import _cuda_backend

GLUON = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TOL = 2e-5      # exact products (e2m1 · e4m3 in fp16, x in fp16 after its 2^-8), fp32 sums: the order alone differs


def _weight(N, K, device):
    w = torch.randn(N, K) * (torch.rand(N, 1) + 0.05)   # rows of different magnitudes exercise the scales
    q, s, gs = encode_nvfp4(w)
    return q.to(device), s.to(device), gs.to(device)


# odd shapes: N not a multiple of a tile, K not a multiple of 128 (x padded with zeros, the words past K masked),
# rows past a tile
@pytest.mark.parametrize("M,N,K", [(37, 50, 144), (70, 150, 208), (129, 33, 272)])
def test_the_twin_equals_the_reference(M, N, K, device):
    q, s, gs = _weight(N, K, device)
    x = torch.randn(M, K, device=device).bfloat16()
    ref = nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    y = LR.rega_linear(x, q, s, gs, out_dtype=torch.float32, twin=True)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert_close(y, ref, TOL, "rega linear twin")
    # the twin that must fail: the scales of the weight's rows rolled by one (each row decoded with its neighbour's)
    wrong = LR.rega_linear(x, q, s.roll(1, 0).contiguous(), gs, out_dtype=torch.float32, twin=True)
    assert rel_err(wrong, ref) > 100 * TOL


def test_leading_dims_dtype_and_bad_shapes(device):
    q, s, gs = _weight(24, 64, device)
    x = torch.randn(2, 3, 64, device=device).bfloat16()
    y = LR.rega_linear(x, q, s, gs, twin=True)
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16
    assert_close(y.float(), nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), 1e-2, "bf16 out")
    assert LR.rega_linear(x[:0], q, s, gs, twin=True).shape == (0, 3, 24)
    with pytest.raises(ValueError, match="rega_linear"):
        LR.rega_linear(torch.randn(4, 48, device=device), q, s, gs, twin=True)


def test_the_switch(monkeypatch):
    """MOESTREAM_DENSE_REGA: off by default (until a device measures it), "1" on, read per call; a bad value names the
    variable. Off sm_90 (here) nothing is able, switch or not."""
    monkeypatch.delenv(LR.REGA_LINEAR_ENV, raising=False)
    assert LR.rega_linear_on() is LR.REGA_LINEAR_DEFAULT
    monkeypatch.setenv(LR.REGA_LINEAR_ENV, "1")
    assert LR.rega_linear_on()
    q, _, _ = _weight(24, 64, "cpu")
    assert not LR.rega_linear_able(torch.randn(256, 64), q)
    monkeypatch.setenv(LR.REGA_LINEAR_ENV, "0")
    assert not LR.rega_linear_on()
    monkeypatch.setenv(LR.REGA_LINEAR_ENV, "on")
    with pytest.raises(ValueError, match=LR.REGA_LINEAR_ENV):
        LR.rega_linear_on()


def test_linear_routes_here_where_able(monkeypatch):
    """`kernels.linear.linear` takes the rega linear for an NVFP4 weight where `rega_linear_able` says so (faked here:
    a CPU has no sm_90) and the tile kernel otherwise; below REGA_LINEAR_MIN_ROWS rows it is not able."""
    import kernels.linear as lin
    q, s, gs = _weight(40, 64, "cpu")
    w = QuantizedWeight("nvfp4", q, s, gs)
    x = torch.randn(300, 64).bfloat16()
    calls = []
    monkeypatch.setattr(LR, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(LR, "rega_linear", lambda *a, **k: calls.append(a[0].shape) or torch.zeros(300, 40))
    monkeypatch.setenv(LR.REGA_LINEAR_ENV, "1")
    assert LR.rega_linear_able(x, q) and not LR.rega_linear_able(x[:LR.REGA_LINEAR_MIN_ROWS - 1], q)
    lin.linear(x, w)
    assert calls == [(300, 64)]
    monkeypatch.setenv(LR.REGA_LINEAR_ENV, "0")
    monkeypatch.setattr(lin, "nvfp4_linear", lambda *a, **k: calls.append("tile") or torch.zeros(300, 40))
    lin.linear(x, w)
    assert calls[-1] == "tile"


@pytest.mark.skipif(not _cuda_backend(), reason="needs Triton's NVIDIA backend (ptxas) to compile")
def test_the_gluon_kernel_compiles_without_spills():
    """Gluon has no interpreter: the CPU's check of the kernel is its compile for sm_90 with the installed Triton, in
    registers (no spill stack), within a CTA's shared memory, and no write to a register an in-flight wgmma reads."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from bench.kernels.linear_rega import compile_report; print(json.dumps(compile_report()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["regs"] <= 255 and r["spill"] == 0 and r["shared"] <= 227 * 1024 and r["hazards"] == [], r


@pytest.mark.skipif(not GLUON, reason="Gluon has no interpreter; wgmma is sm_90 only")
@pytest.mark.parametrize("M,N,K", [(300, 150, 272), (1024, 18560, 4096), (1000, 4096, 5376), (129, 1024, 4096)])
def test_the_gluon_kernel_equals_the_reference(M, N, K):
    """On sm_90: odd shapes and Super's (in_proj, shared down, the latent fc1) against the fp32 reference and the
    twin, bf16 out as the engine runs it; the must-fail twin: rolled scales."""
    q, s, gs = _weight(N, K, "cuda")
    x = torch.randn(M, K, device="cuda").bfloat16()
    ref = nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    y32 = LR.rega_linear(x, q, s, gs, out_dtype=torch.float32, twin=False)
    assert_close(y32, ref, TOL, "gluon rega linear")
    assert_close(y32, LR.rega_linear(x, q, s, gs, out_dtype=torch.float32, twin=True), TOL, "gluon vs twin")
    y = LR.rega_linear(x, q, s, gs, twin=False)
    assert y.dtype == torch.bfloat16 and rel_err(y.float(), ref) < 4e-3
    assert rel_err(LR.rega_linear(x, q, s.roll(1, 0).contiguous(), gs, twin=False).float(), ref) > 0.1
