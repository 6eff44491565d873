"""The NVFP4 decode GEMV on the CUDA cores (kernels/gemv_nvfp4_fma.py, session 12 h-gemv) against its PyTorch
twin `nvfp4_linear_torch`: odd N (1,023, 37, 5), K a multiple of 32 that is no multiple of the slice (partial chunks
and lanes past the slice), one and several K-slices (the split-K join), M = 1 and 2, rows per program that leave a
partial row block; must-fail twins (nibbles swapped, one scale group shifted) that the same check catches; the
inline-PTX decode string run on kernels.testing's model of the PTX against the e2m1 table for every byte.

Under the interpreter the kernel runs the same arithmetic as its PTX in plain Triton ops (fp16 pairs rounded after
every multiply-add, as HFMA2 rounds), so the tolerance is the fp16 math's (~1e-3), not the fp32 GEMV's 2e-5.

The route (session 13, h-fmaroute): nvfp4_linear reaches the FMA kernel through a GEMV_CHOICES entry with an 'FMA'
key (keyed here by arch 0, the interpreter's), honours out= / out_dtype and x in bf16 and fp16 there, and leaves it
under MOESTREAM_GEMV_FMA=0 or a caller's config without 'FMA'; on a GPU, the routed call inside a CUDA graph."""
import pytest
import torch

from kernels import gemv_nvfp4_fma as f
from gemv_cases import activations as _x, counters_zero as _counters_zero, poisoned as _poisoned, weight as _weight
from kernels import gemv_nvfp4 as g
from kernels.nvfp4 import E2M1_VALUES, swap_nibbles
from kernels.testing import assert_close, fp16_value, rel_err, run_ptx

TOL = 4e-3      # fp16 products and sums: ~1e-3 measured here; a swapped nibble or a shifted group is > 0.1
N_SM = 4


@pytest.fixture(autouse=True)
def _four_sms(monkeypatch):
    monkeypatch.setattr(f, "_n_sm", lambda device: N_SM)


# (M, N, K, config): slices of C x 1,024 codes; K = 1,056 = 33 chunks of 32 codes
CASES = [
    (1, 1023, 1056, dict(C=1, R=8, num_warps=4, PPS=2)),        # 2 slices of 17 / 16 chunks: lanes past the slice
    (1, 37, 2080, dict(C=2, R=2, num_warps=1, PPS=1)),          # 2 slices, 5 programs of 8 rows: partial blocks
    (1, 5, 512, dict(C=1, R=1, num_warps=1, PPS=2)),            # one slice, half its lanes idle
    (2, 63, 1056, dict(C=2, R=8, num_warps=4, PPS=1)),          # one slice, M = 2, a partial row block
    (2, 37, 3104, dict(C=1, R=2, num_warps=2, PPS=3)),          # 4 slices, M = 2
    (1, 36, 4096, dict(C=4, R=4, num_warps=4, PPS=1)),          # the default C at M = 1, one slice
]


def _run(x, q, s, gs, cfg, device, **kw):
    return f.nvfp4_linear_fma(x, q, s, gs, out_dtype=torch.float32, config=cfg,
                              out=_poisoned(x.shape[0], q.shape[0], device), **kw)


@pytest.mark.parametrize("M,N,K,cfg", CASES)
def test_fma_matches_twin(M, N, K, cfg, device):
    q, s, gs = _weight(N, K, device, seed=N + K + M)
    x = _x(M, K, device, seed=M + N) * 30.0      # away from 1: the per-slice x scaling must undo itself
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    y = _run(x, q, s, gs, cfg, device)
    assert_close(y, ref, TOL, f"FMA GEMV {cfg}")
    assert _counters_zero(device), "arrival counters left non-zero for the next call"
    assert torch.equal(_run(x, q, s, gs, cfg, device), y), "a second call differs: the join is not deterministic"


@pytest.mark.parametrize("M,N,K,cfg", CASES[:2])
def test_fma_must_fail_twins(M, N, K, cfg, device):
    """The check above catches a decode with the nibbles swapped and the scales of one 16-group shifted by one."""
    q, s, gs = _weight(N, K, device, seed=7 + N)
    x = _x(M, K, device, seed=3)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    assert rel_err(_run(x, swap_nibbles(q), s, gs, cfg, device), ref) > 0.1
    s_shift = s.view(torch.uint8).clone()
    s_shift[:, 1:] = s.view(torch.uint8)[:, :-1]
    assert rel_err(_run(x, q, s_shift.view(s.dtype), gs, cfg, device), ref) > 0.05


def test_decode_ptx_matches_e2m1_table():
    """DECODE_PTX on the PTX model: every byte value in every byte of a word gives pair q = (code q, code q + 4) as
    fp16 equal to e2m1 * 2^-14 exactly (subnormals included, signs and -0 kept)."""
    for b in range(256):
        for pos in range(4):
            r = b << (8 * pos)
            pairs = run_ptx(f.DECODE_PTX, [r])
            codes = [(r >> (4 * i)) & 15 for i in range(8)]
            for qi in range(4):
                lo, hi = fp16_value(pairs[qi]), fp16_value(pairs[qi] >> 16)
                assert lo == E2M1_VALUES[codes[qi]] * 2.0 ** -14, (hex(r), qi)
                assert hi == E2M1_VALUES[codes[qi + 4]] * 2.0 ** -14, (hex(r), qi)
                assert (pairs[qi] >> 15 & 1, pairs[qi] >> 31 & 1) == (codes[qi] >> 3, codes[qi + 4] >> 3)


def test_config_slices():
    c = f.fma_config(1, 18560, 4096, torch.device("cpu"), n_sm=132)
    assert (c["SLICES"], c["slice_w"], c["programs"]) == (1, 512, 395)          # 47 rows a program
    c = f.fma_config(1, 4096, 5376, torch.device("cpu"), dict(C=2), n_sm=132)
    assert (c["SLICES"], c["slice_w"]) == (3, 224)          # 1,792 codes a slice: 56 of 64 lanes' chunks
    with pytest.raises(ValueError):
        f.nvfp4_linear_fma(torch.zeros(1, 48), torch.zeros(3, 24, dtype=torch.uint8),
                           torch.zeros(3, 3, dtype=torch.uint8), 1.0)


# ---- the route through nvfp4_linear (session 13, h-fmaroute) ----------------------------------------------------

def _route(monkeypatch, N, K, cfg):
    """A GEMV_CHOICES entry for this device's arch that says FMA, and a record of the FMA launcher's calls."""
    monkeypatch.setitem(g.GEMV_CHOICES, (g._arch(torch.device("cuda" if torch.cuda.is_available() else "cpu")), 1,
                                         N, K), {"FMA": cfg})
    calls = []
    real = f.nvfp4_linear_fma
    monkeypatch.setattr(f, "nvfp4_linear_fma", lambda *a, **kw: calls.append(kw.get("config")) or real(*a, **kw))
    return calls


# (N, K, fma config, x dtype, out_dtype, out buffer dtype or None)
ROUTE_CASES = [
    (37, 512, dict(C=1, R=2, num_warps=1, PPS=1), torch.bfloat16, torch.float32, torch.float32),   # one slice
    (29, 2080, dict(C=1, R=2, num_warps=2, PPS=1), torch.float16, None, None),    # 3 slices: the join, fp16 y
    (21, 1056, dict(C=1, R=1, num_warps=1, PPS=2), torch.bfloat16, torch.bfloat16, torch.bfloat16),  # 2 slices
]


@pytest.mark.parametrize("N,K,cfg,x_dtype,out_dtype,out_buf", ROUTE_CASES)
def test_route_reaches_fma_and_matches_twin(N, K, cfg, x_dtype, out_dtype, out_buf, device, monkeypatch):
    q, s, gs = _weight(N, K, device, seed=N * K)
    x = (_x(1, K, device, seed=N + 5).float() * 7.0).to(x_dtype)
    calls = _route(monkeypatch, N, K, cfg)
    out = None if out_buf is None else torch.full((1, N), float("nan"), dtype=out_buf, device=device)
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=out_dtype, out=out)
    assert calls == [cfg], calls
    assert y.dtype == (out_dtype or x_dtype) and y.shape == (1, N)
    if out is not None:
        assert y.data_ptr() == out.data_ptr(), "out= not written"
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    # the FMA's fp16 math plus y's own rounding (bf16 2^-8 relative, half-ulp; fp16 2^-11)
    assert_close(y.float(), ref, TOL + (4e-3 if y.dtype == torch.bfloat16 else 0.0), f"routed FMA {cfg}")
    direct = f.nvfp4_linear_fma(x, q, s, gs, out_dtype=y.dtype, config=cfg)
    assert torch.equal(y, direct), "the routed call is not the FMA kernel's result"
    assert _counters_zero(device)


def test_route_must_fail_twins(device, monkeypatch):
    """The routed call's check catches swapped nibbles and the scales of one 16-group shifted by one."""
    N, K, cfg = 29, 2080, dict(C=1, R=2, num_warps=2, PPS=1)
    q, s, gs = _weight(N, K, device, seed=41)
    x = _x(1, K, device, seed=42)
    _route(monkeypatch, N, K, cfg)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    assert rel_err(g.nvfp4_linear(x, swap_nibbles(q), s, gs, out_dtype=torch.float32), ref) > 0.1
    s_shift = s.view(torch.uint8).clone()
    s_shift[:, 1:] = s.view(torch.uint8)[:, :-1]
    assert rel_err(g.nvfp4_linear(x, q, s_shift.view(s.dtype), gs, out_dtype=torch.float32), ref) > 0.05


def test_fma_switch_and_callers_config_bypass_it(device, monkeypatch):
    """MOESTREAM_GEMV_FMA=0 (read by `_fma_on`) drops the 'FMA' keys and the entry's tensor-core keys run; so does a
    caller's config that does not name FMA; M = 2 never meets an M = 1 entry."""
    assert g._fma_on({}) and g._fma_on({"MOESTREAM_GEMV_FMA": "1"}) and not g._fma_on({"MOESTREAM_GEMV_FMA": "0"})
    N, K, cfg = 37, 512, dict(C=1, R=2, num_warps=1, PPS=1)
    q, s, gs = _weight(N, K, device, seed=51)
    x = _x(1, K, device, seed=52)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    calls = _route(monkeypatch, N, K, cfg)
    assert g.gemv_config(1, N, K, torch.device(device))["FMA"] == cfg
    monkeypatch.setattr(g, "_FMA_ON", False)
    assert "FMA" not in g.gemv_config(1, N, K, torch.device(device))
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32)
    monkeypatch.setattr(g, "_FMA_ON", True)
    y_cfg = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=dict(SPLIT_K=1))
    assert calls == [], "the tensor-core path went through the FMA launcher"
    assert_close(y, ref, 2e-5, "tensor cores with MOESTREAM_GEMV_FMA=0")      # the fp32 GEMV's bound, not fp16's
    assert_close(y_cfg, ref, 2e-5, "tensor cores under a caller's config")
    assert "FMA" not in g.gemv_config(2, N, K, torch.device(device))
    g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=dict(FMA=cfg))      # a caller may ask for it
    assert calls == [cfg]


def test_sm90_entries():
    """The six shapes measured faster on the H200 at M = 1 carry an FMA config that plans (slices within C x 1,024),
    the ones that lost (fc1 / fc2, M = 2) do not; every FMA entry keeps a tensor-core choice for the A/B."""
    won = [(18560, 4096), (4096, 8192), (4096, 4096), (5376, 4096), (4096, 5376), (131072, 4096)]
    for N, K in won:
        e = g.GEMV_CHOICES[(90, 1, N, K)]
        assert "FMA" in e and set(e) - {"FMA"}, (N, K)
        c = f.fma_config(1, N, K, torch.device("cpu"), e["FMA"], n_sm=132)
        assert c["SLICES"] <= 2 and c["programs"] <= 4096, (N, K, c)
    for N, K in [(1024, 4096), (4096, 1024), (256, 4096)]:
        assert "FMA" not in g.GEMV_CHOICES[(90, 1, N, K)]
    assert not any("FMA" in v for (arch, m, _, _), v in g.GEMV_CHOICES.items() if m != 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_route_in_cuda_graph(monkeypatch):
    """The routed FMA GEMV captured in a CUDA graph (as the decode is) and replayed with new x: each replay equals the
    twin, the split-K counters are back at zero after every replay (out_proj's shape: 2 slices; q/o's: one)."""
    dev = torch.device("cuda")
    arch = g._arch(dev)
    shapes = [(4096, 8192, dict(C=4, R=2, PPS=2)), (4096, 4096, dict(C=4, R=2, PPS=2))]
    for N, K, cfg in shapes:
        monkeypatch.setitem(g.GEMV_CHOICES, (arch, 1, N, K), {**g.GEMV_CHOICES.get((arch, 1, N, K), {}), "FMA": cfg})
    calls = []
    real = f.nvfp4_linear_fma
    monkeypatch.setattr(f, "nvfp4_linear_fma", lambda *a, **kw: calls.append(kw.get("config")) or real(*a, **kw))
    ws = [_weight(N, K, "cuda", seed=N + K) for N, K, _ in shapes]
    xs = [torch.zeros(1, K, device=dev, dtype=torch.bfloat16) for _, K, _ in shapes]
    for x in xs:
        x.copy_(_x(1, x.shape[1], "cuda", seed=1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for w, x in zip(ws, xs):      # first calls (compilation, the stream's counter set) before the capture
            g.nvfp4_linear(x, *w)
        side.synchronize()
        with torch.cuda.graph(graph, stream=side):
            ys = [g.nvfp4_linear(x, *w) for w, x in zip(ws, xs)]
    torch.cuda.current_stream().wait_stream(side)
    assert calls == [c for _, _, c in shapes] * 2, calls          # warm-up and capture both took the FMA route
    for rep in range(3):
        for x in xs:
            x.copy_(_x(1, x.shape[1], "cuda", seed=100 + rep))
        graph.replay()
        torch.cuda.synchronize()
        for w, x, y in zip(ws, xs, ys):
            assert rel_err(y.float(), g.nvfp4_linear_torch(x, *w, out_dtype=torch.float32)) < 5e-3, rep
        assert _counters_zero("cuda"), rep
