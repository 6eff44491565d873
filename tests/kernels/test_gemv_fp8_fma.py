"""kernels/gemv_fp8_fma.py (session 36's FP8 GEMV on the CUDA cores) against its fp32 twin under Triton's
interpreter: odd row counts, K-slices of unequal length, both x rows, codes over the whole e4m3 range; the twins that
must fail (codes paired with the wrong x, signs flipped, x scaled past the fp16 headroom); the inline-PTX decode on
kernels.testing's model of the PTX against torch's e4m3 for every code. (tests/conftest.py sets the interpreter on a
machine without a GPU; with one, the kernel runs its PTX.) The route: fp8_linear reaches it through an
FP8_GEMV_CHOICES entry with an 'FMA' key (keyed here by this device's arch), leaves it under MOESTREAM_GEMV_FMA=0, a
caller's config without 'FMA' or M = 2; on a GPU, the routed call inside a CUDA graph."""
import pytest
import torch

from kernels import gemv_fp8_fma as k
from bench.kernels.gemv_fma_sweep import Fp8Fma
from gemv_cases import counters_zero
from kernels import gemv_nvfp4 as g
from kernels.gemv_nvfp4 import fp8_linear_torch
from kernels.testing import fp16_value, rel_err, run_ptx

SMALL = dict(R=1, num_warps=2, PPS=1)       # two rows a block: few interpreted programs
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n, kk, seed):
    """e4m3 codes over the whole range but NaN, and a per-tensor scale."""
    b = torch.randint(0, 256, (n, kk), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.view(torch.float8_e4m3fn).to(DEV), torch.tensor(3e-3, device=DEV)


def _x(m, kk, seed):
    x = torch.randn(m, kk, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 40.0                          # an outlier sets the slice's power of two
    return x.bfloat16().to(DEV)


@pytest.mark.parametrize("m, n, kk, cfg, slices", [
    (1, 7, 528, dict(C=1), 2),               # 33 lane chunks: slices of 17 and 16, the split join
    (2, 5, 1040, dict(C=2), 2),              # both x rows, 65 chunks over two slices
    (1, 9, 272, {}, 1),                      # 17 chunks in one slice: idle lanes in the second chunk
    (1, 3, 2064, dict(C=8), 1),              # eight chunks a lane (x scaled into [1, 2)), 129 of 256 used
])
def test_fp8_fma_equals_the_twin(m, n, kk, cfg, slices):
    w, sc = _weights(n, kk, seed=n + kk)
    x = _x(m, kk, seed=kk)
    c = {**SMALL, **cfg}
    assert k.fp8_fma_config(m, n, kk, torch.device(DEV), c)["SLICES"] == slices
    ref = fp8_linear_torch(x, w, sc, out_dtype=torch.float32)
    y = k.fp8_linear_fma(x, w, sc, out_dtype=torch.float32, config=c)
    assert y.shape == (m, n) and rel_err(y, ref) < 2e-3
    # the must-fail twins through the same kernel: each code against its pair neighbour's x; every sign flipped
    swapped = w.view(torch.uint8).view(-1, 2).flip(1).reshape(n, kk).view(torch.float8_e4m3fn)
    assert rel_err(k.fp8_linear_fma(x, swapped, sc, out_dtype=torch.float32, config=c), ref) > 0.1
    flipped = (w.view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)
    assert rel_err(k.fp8_linear_fma(x, flipped, sc, out_dtype=torch.float32, config=c), ref) > 0.1


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # the twin's overflow
@pytest.mark.parametrize("c", [4, 8])
def test_fp16_sums_hold_the_largest_codes(c):
    """Every code 448 and x all at the top of its power of two (1.9921875), C chunks a lane in one slice: the lane's
    fp16 sum reaches 57,120 (< 65,504) whatever C, and the result is exact; the twin with x scaled one power of two
    higher than `x_top(C)` overflows to inf."""
    n, kk = 1, 512 * c
    w = torch.full((n, kk), 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn).to(DEV)
    x = torch.full((1, kk), 1.9921875).bfloat16().to(DEV)
    one = torch.tensor(1.0, device=DEV)
    cfg = dict(SMALL, C=c)
    assert k.fp8_fma_config(1, n, kk, torch.device(DEV), cfg)["SLICES"] == 1
    y = k.fp8_linear_fma(x, w, one, out_dtype=torch.float32, config=cfg)
    assert torch.equal(y.cpu(), torch.full((1, n), 448.0 * 1.9921875 * kk))
    bad = k.fp8_linear_fma(x, w, one, out_dtype=torch.float32, config=dict(cfg, X_TOP=k.x_top(c) + 1))
    assert rel_err(bad, y) == float("inf")


def test_config_and_shapes_refused():
    for c in (16, 3):
        with pytest.raises(ValueError, match="power of two of at most 8 chunks"):
            k.fp8_fma_config(1, 8, 8192, torch.device(DEV), dict(C=c))
    assert [k.x_top(c) for c in (1, 2, 4, 8)] == [4, 3, 2, 1]
    w, sc = _weights(4, 40, seed=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        k.fp8_linear_fma(torch.ones(1, 40, device=DEV).bfloat16(), w, sc)
    w, sc = _weights(4, 64, seed=0)
    with pytest.raises(ValueError, match="1-2 rows"):
        k.fp8_linear_fma(torch.ones(3, 64, device=DEV).bfloat16(), w, sc)


def test_sweep_hooks_draw_no_nan_and_break_the_pairing():
    (w, sc), = Fp8Fma.weights(64, 256, 1, seed=3)
    w = w.cpu()
    codes = w.view(torch.uint8)
    assert not torch.isnan(w.float()).any() and int(codes.max()) == 0xFE and int((codes & 0x7F).max()) == 0x7E
    broken, _ = Fp8Fma.broken((w, sc.cpu()))
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


# ---- the route through fp8_linear (FP8_GEMV_CHOICES' 'FMA' key) -------------------------------------------------

def _route(monkeypatch, n, kk, cfg):
    """An FP8_GEMV_CHOICES entry for this device's arch that says FMA, and a record of the FMA launcher's calls."""
    key = (g._arch(torch.device(DEV)), 1, n, kk)
    monkeypatch.setitem(g.FP8_GEMV_CHOICES, key, {**g.FP8_GEMV_CHOICES.get(key, {}), "FMA": cfg})
    calls = []
    real = k.fp8_linear_fma
    monkeypatch.setattr(k, "fp8_linear_fma", lambda *a, **kw: calls.append(kw.get("config")) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("out_dtype, out_buf", [(torch.float32, torch.float32), (None, None)])
def test_route_reaches_fma_and_matches_twin(out_dtype, out_buf, monkeypatch):
    n, kk, cfg = 7, 528, dict(SMALL, C=1)
    w, sc = _weights(n, kk, seed=11)
    x = _x(1, kk, seed=12)
    calls = _route(monkeypatch, n, kk, cfg)
    out = None if out_buf is None else torch.full((1, n), float("nan"), dtype=out_buf, device=DEV)
    y = g.fp8_linear(x, w, sc, out_dtype=out_dtype, out=out)
    assert calls == [cfg] and y.shape == (1, n) and y.dtype == (out_dtype or x.dtype)
    if out is not None:
        assert y.data_ptr() == out.data_ptr(), "out= not written"
    ref = fp8_linear_torch(x, w, sc, out_dtype=torch.float32)
    assert rel_err(y, ref) < (2e-3 if y.dtype == torch.float32 else 6e-3)     # bf16 y: its own rounding on top
    assert torch.equal(y, k.fp8_linear_fma(x, w, sc, out_dtype=y.dtype, config=cfg))
    # the must-fail twin through the route: codes paired with the wrong x
    swapped = w.view(torch.uint8).view(-1, 2).flip(1).reshape(n, kk).view(torch.float8_e4m3fn)
    assert rel_err(g.fp8_linear(x, swapped, sc, out_dtype=torch.float32), ref) > 0.1
    assert counters_zero(DEV)


def test_fma_switch_callers_config_and_two_rows_bypass_it(monkeypatch):
    n, kk, cfg = 7, 528, dict(SMALL, C=1)
    w, sc = _weights(n, kk, seed=21)
    x = _x(2, kk, seed=22)
    calls = _route(monkeypatch, n, kk, cfg)
    ref = fp8_linear_torch(x, w, sc, out_dtype=torch.float32)
    assert g.fp8_gemv_config(n, kk, torch.device(DEV), M=1)["FMA"] == cfg
    monkeypatch.setattr(g, "_FMA_ON", False)
    assert "FMA" not in g.fp8_gemv_config(n, kk, torch.device(DEV), M=1)
    y_off = g.fp8_linear(x[:1], w, sc, out_dtype=torch.float32)
    monkeypatch.setattr(g, "_FMA_ON", True)
    y_cfg = g.fp8_linear(x[:1], w, sc, out_dtype=torch.float32, config=dict(SPLIT_K=1))
    y_two = g.fp8_linear(x, w, sc, out_dtype=torch.float32)           # M = 2 meets no M = 1 entry
    assert calls == [], "a tensor-core call went through the FMA launcher"
    for y, r in ((y_off, ref[:1]), (y_cfg, ref[:1]), (y_two, ref)):
        assert rel_err(y, r) < 2e-3
    g.fp8_linear(x[:1], w, sc, out_dtype=torch.float32, config=dict(FMA=cfg))     # a caller may ask for it
    assert calls == [cfg]


def test_sm90_entries():
    """Every Super FP8 shape carries an FMA config at M = 1 that plans (C <= 8, at most 4 slices, <= 4,096
    programs) beside the tensor-core choice that MOESTREAM_GEMV_FMA=0 runs; no M > 1 entry routes there."""
    for (arch, m, n, kk), e in g.FP8_GEMV_CHOICES.items():
        if arch == 90 and m == 1:
            assert "FMA" in e and set(e) - {"FMA"}, (n, kk)
            c = k.fp8_fma_config(1, n, kk, torch.device("cpu"), e["FMA"], n_sm=132)
            assert c["SLICES"] <= 4 and c["programs"] <= 4096, (n, kk, c)
        else:
            assert "FMA" not in e, (arch, m, n, kk)
    assert {(n, kk) for (a, m, n, kk) in g.FP8_GEMV_CHOICES if a == 90 and m == 1} == {
        (18560, 4096), (4096, 8192), (5376, 4096), (4096, 5376), (1024, 4096)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_route_in_cuda_graph(monkeypatch):
    """The routed FP8 FMA GEMV captured in a CUDA graph (as the decode is) and replayed with new x: each replay equals
    the twin, the split-K counters are back at zero after every replay (out_proj's shape: 2 slices; fc1's: one)."""
    dev = torch.device("cuda")
    shapes = [(4096, 8192, dict(C=8, R=1, PPS=3)), (1024, 4096, dict(C=8, R=1, PPS=3))]
    calls = []
    for n, kk, cfg in shapes:
        calls = _route(monkeypatch, n, kk, cfg) if not calls else calls
        key = (g._arch(dev), 1, n, kk)
        monkeypatch.setitem(g.FP8_GEMV_CHOICES, key, {**g.FP8_GEMV_CHOICES.get(key, {}), "FMA": cfg})
    ws = [_weights(n, kk, seed=n + kk) for n, kk, _ in shapes]
    xs = [torch.zeros(1, kk, device=dev, dtype=torch.bfloat16) for _, kk, _ in shapes]
    for x in xs:
        x.copy_(_x(1, x.shape[1], seed=1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for w, x in zip(ws, xs):      # first calls (compilation, the stream's counter set) before the capture
            g.fp8_linear(x, *w)
        side.synchronize()
        with torch.cuda.graph(graph, stream=side):
            ys = [g.fp8_linear(x, *w) for w, x in zip(ws, xs)]
    torch.cuda.current_stream().wait_stream(side)
    assert calls == [c for _, _, c in shapes] * 2, calls          # warm-up and capture both took the FMA route
    for rep in range(3):
        for x in xs:
            x.copy_(_x(1, x.shape[1], seed=100 + rep))
        graph.replay()
        torch.cuda.synchronize()
        for w, x, y in zip(ws, xs, ys):
            assert rel_err(y.float(), fp8_linear_torch(x, *w, out_dtype=torch.float32)) < 5e-3, rep
        assert counters_zero("cuda"), rep
