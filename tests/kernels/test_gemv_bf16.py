"""kernels/gemv_bf16.py: the bf16 GEMV against its fp32 twin (odd N, K past a tile, one and three x rows, a must-fail
twin with K reversed), and its route: `linear` sends a bf16 weight at M = 1 there only for the shapes
BF16_GEMV_CHOICES names (keyed here by this device's arch), never for M = 2, fp32 x or with MOESTREAM_GEMV_CHOICES=0."""
import pytest
import torch

from kernels import backend
from kernels import gemv_bf16 as b
from kernels import gemv_nvfp4 as g
from kernels.linear import QuantizedWeight, linear
from kernels.testing import rel_err


def _w(n, k, device, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16().to(device)


@pytest.mark.parametrize("m", [1, 3])
def test_bf16_gemv_equals_the_twin(m, device):
    n, k = 37, 200                                   # 37 rows of a 128-row block, K past one 128-wide tile
    w = _w(n, k, device, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 9)).bfloat16().to(device)
    ref = x.float() @ w.float().t()
    y = b.bf16_gemv(x, w)
    assert y.shape == (m, n) and rel_err(y, ref) < 1e-5            # exact products, fp32 sums
    assert rel_err(b.bf16_gemv(x, w.flip(1).contiguous()), ref) > 0.5


def test_bf16_output_is_rounded_in_the_kernel(device):
    """out_dtype bf16 (what the route asks for, one launch fewer than a cast) equals the fp32 row rounded to nearest
    even; the twin that must fail is the same row truncated."""
    n, k = 301, 200
    w = _w(n, k, device, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).bfloat16().to(device)
    y32 = b.bf16_gemv(x, w)
    y16 = b.bf16_gemv(x, w, out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.to(torch.bfloat16))
    truncated = (y32.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(y16, truncated)


@pytest.fixture
def routed(monkeypatch, device):
    """One BF16_GEMV_CHOICES entry for this device's arch, Triton forced for the ops (the interpreter on a CPU), and a
    record of bf16_gemv's calls."""
    n, k = 37, 200
    monkeypatch.setitem(b.BF16_GEMV_CHOICES, (g._arch(torch.device(device)), 1, n, k), {})
    monkeypatch.setattr(backend, "FORCED", {"gemv_nvfp4": "triton"})
    calls = []
    real = b.bf16_gemv
    monkeypatch.setattr(b, "bf16_gemv", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    return n, k, calls


def test_linear_routes_the_named_shape_at_one_row(routed, device, monkeypatch):
    n, k, calls = routed
    w = QuantizedWeight("dense", _w(n, k, device, seed=5))
    x = torch.randn(1, 1, k, generator=torch.Generator().manual_seed(6)).bfloat16().to(device)
    y = linear(x, w)
    assert calls == [(n, k)] and y.shape == (1, 1, n) and y.dtype == torch.bfloat16
    assert rel_err(y.float(), x.float() @ w.weight.float().t()) < 4e-3       # y rounded to bf16, as F.linear's
    assert torch.equal(y.reshape(1, n), b.bf16_gemv(x.reshape(1, k), w.weight).to(torch.bfloat16))
    calls.clear()
    linear(torch.randn(2, k).bfloat16().to(device), w)                        # M = 2
    linear(torch.randn(1, k).to(device), QuantizedWeight("dense", w.weight.float()))     # fp32
    linear(torch.randn(1, k).bfloat16().to(device), QuantizedWeight("dense", _w(n + 1, k, device, seed=7)))
    monkeypatch.setattr(b, "_CHOICES_ON", False)
    linear(x, w)
    assert calls == [], "a call the choices do not name went through the bf16 GEMV"


def test_sm90_entries_are_the_measured_winners():
    assert set(b.BF16_GEMV_CHOICES) == {(90, 1, 18560, 4096), (90, 1, 131072, 4096)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_routed_lm_head_in_cuda_graph():
    """The lm_head's shape through `linear` on sm_90 (routed when the device is one) captured in a CUDA graph, as the
    decode's final stretch is, and replayed with new x: each replay equals the twin."""
    dev = torch.device("cuda")
    w = QuantizedWeight("dense", torch.randn(131072, 4096, device=dev, dtype=torch.bfloat16))
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        linear(x, w)
        side.synchronize()
        with torch.cuda.graph(graph, stream=side):
            y = linear(x, w)
    torch.cuda.current_stream().wait_stream(side)
    for rep in range(2):
        x.copy_(torch.randn(1, 4096, device=dev, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y.float(), x.float() @ w.weight.float().t()) < 4e-3, rep
    assert (g._arch(dev) != 90) or b.bf16_linear_routed(x, w.weight) is not None
