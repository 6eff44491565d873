"""The decode GEMVs over balanced shares (STREAM_K) and the scales loaded ahead (SCALE_AHEAD), issue 19 part 1.

Each against its PyTorch twin on odd shapes (N = 1,023 and others no multiple of BLOCK_N, K a multiple of 16 but not
of the K-tile), with shares that end inside row blocks (partials joined by the last to arrive), span several row
blocks, or hold one tile; each with a must-fail twin (swapped nibbles, a scale group shifted by one, the scales of
the next K-tile — what a prefetch one tile off would read —, a stale arrival counter, FP8 signs flipped)."""
import pytest
import torch

from gemv_cases import activations as _x, counters_zero as _counters_zero, poisoned as _poisoned, weight as _weight
from kernels import gemv_nvfp4 as g
from kernels.nvfp4 import encode_fp8, swap_nibbles
from kernels.testing import assert_close, rel_err

TOL = 2e-5
N_SM = 4    # shares planned for 4 SMs on every device, so that each case cuts row blocks as described


@pytest.fixture(autouse=True)
def _four_sms(monkeypatch):
    monkeypatch.setattr(g, "_n_sm", lambda device: N_SM)


def _shares(M, N, K, cfg):
    """(row blocks, K-tiles per row block, tiles per program) as nvfp4_linear plans them."""
    c = {**g.gemv_config(M, N, K, torch.device("cpu"), N_SM), **cfg}
    block_k = 256 // c["M_PAD"] if c["LOAD_MODE"] == 8 else c["BLOCK_K"]
    blocks, tiles = -(-N // c["BLOCK_N"]), -(-K // block_k)
    return blocks, tiles, g.stream_k_shares(blocks * tiles, cfg["STREAM_K"] * N_SM)[1]


# (M, N, K, config, what the shares do); K = 272 is 1 + 1/16 K-tiles of 256
NVFP4_CASES = [
    (1, 1023, 272, dict(STREAM_K=1), "whole"),                         # 16 row blocks x 2 tiles, 8 tiles a share
    (1, 1023, 272, dict(STREAM_K=3, X_BUILD=True, SCALE_AHEAD=1), "cut"),   # 3 tiles a share
    (1, 100, 2048, dict(STREAM_K=2, SCALE_AHEAD=1), "cut"),            # 8 tiles a row block, 2 a share: 4 partials
    (1, 37, 1024, dict(STREAM_K=8, SCALE_AHEAD=2), "cut"),             # 1 tile a share
    (1, 300, 1040, dict(STREAM_K=2, BLOCK_N=32, num_warps=2, X_BUILD=True), "cut"),
    (2, 50, 272, dict(STREAM_K=2, X_BUILD=True, SCALE_AHEAD=1), "cut"),        # mode 8 at M_PAD 2: K-tiles of 128
    (3, 37, 512, dict(STREAM_K=2, SCALE_AHEAD=1), "cut"),              # mode 9
    (5, 190, 1040, dict(STREAM_K=3, X_BUILD=True, SCALE_AHEAD=2), "cut"),
    (8, 24, 512, dict(STREAM_K=1, X_INLINE=True), "cut"),
    (1, 130, 272, dict(STREAM_K=4, LOAD_MODE=9, BLOCK_K=256, SCALE_AHEAD=1), "cut"),
    (1, 1023, 1040, dict(STREAM_K=3, X_BUILD=True, X_AHEAD=True, SCALE_AHEAD=1), "cut"),
    (1, 300, 1040, dict(STREAM_K=6, BLOCK_N=32, num_warps=2, X_BUILD=True, X_AHEAD=True), "cut"),
    (2, 70, 400, dict(STREAM_K=2, X_BUILD=True, X_AHEAD=True), "cut"),
    (6, 90, 1040, dict(STREAM_K=2, X_BUILD=True, X_AHEAD=True, SCALE_AHEAD=1), "cut"),
]


@pytest.mark.parametrize("M,N,K,cfg,what", NVFP4_CASES)
def test_stream_k_matches_twin(M, N, K, cfg, what, device):
    blocks, tiles, per = _shares(M, N, K, cfg)
    assert (per % tiles != 0) == (what == "cut"), (blocks, tiles, per)      # the case exercises what it says
    q, s, gs = _weight(N, K, device, seed=N + K + M)
    x = _x(M, K, device, seed=M + N)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    y1 = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
    assert_close(y1, ref, TOL, f"STREAM_K {cfg}")
    assert _counters_zero(device), "arrival counters left non-zero for the next call"
    y2 = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
    assert torch.equal(y1, y2), "the partials' join depends on the arrival order"


def test_stream_k_stores_the_output_dtype(device):
    q, s, gs = _weight(45, 1024, device, seed=21)
    x = _x(1, 1024, device, seed=22)
    y = g.nvfp4_linear(x, q, s, gs, config=dict(STREAM_K=4))
    assert y.dtype == torch.bfloat16 and y.shape == (1, 45)
    assert_close(y.float(), g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), 5e-3, "bf16 out")


@pytest.mark.parametrize("cfg", [dict(SPLIT_K=2, SPLIT_REDUCE=1, SCALE_AHEAD=1), dict(SPLIT_K=1, SCALE_AHEAD=2),
                                 dict(SPLIT_K=3, SPLIT_REDUCE=1, X_BUILD=True, SCALE_AHEAD=1),
                                 dict(SPLIT_K=2, SPLIT_REDUCE=1, ONE_DOT=True, SCALE_AHEAD=1),
                                 dict(SPLIT_K=2, SPLIT_REDUCE=1, X_BUILD=True, X_AHEAD=True)])
@pytest.mark.parametrize("M", [1, 4])
def test_scale_ahead_in_the_split_kernel_matches_twin(cfg, M, device):
    """SCALE_AHEAD in today's kernel: the prefetch crosses split boundaries and the end of K (masked)."""
    if cfg.get("ONE_DOT") and M == 4:
        cfg = dict(cfg, LOAD_MODE=8)
    N, K = 1023, 1040
    q, s, gs = _weight(N, K, device, seed=M + 30)
    x = _x(M, K, device, seed=M + 31)
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, f"SCALE_AHEAD {cfg}")


def test_x_ahead_needs_x_built(device):
    q, s, gs = _weight(40, 256, device, seed=44)
    x = _x(1, 256, device, seed=45)
    for cfg in (dict(X_AHEAD=True), dict(X_AHEAD=True, X_BUILD=True, ONE_DOT=True)):
        with pytest.raises(ValueError, match="X_AHEAD"):
            g.nvfp4_linear(x, q, s, gs, config=cfg)


@pytest.mark.parametrize("cfg", [dict(STREAM_K=2, SCALE_AHEAD=1), dict(STREAM_K=3, X_BUILD=True, SCALE_AHEAD=2),
                                 dict(STREAM_K=3, X_BUILD=True, X_AHEAD=True, SCALE_AHEAD=1),
                                 dict(SPLIT_K=2, SPLIT_REDUCE=1, SCALE_AHEAD=1)])
def test_must_fail_swapped_nibbles_and_shifted_scales(cfg, device):
    """Broken weights are caught: nibbles swapped, the scales one 16-group off, and every row's scales one K-tile
    (16 groups) off — the scales a prefetch one tile ahead of its tile would apply."""
    N, K = 100, 2048
    q, s, gs = _weight(N, K, device, seed=40)
    x = _x(1, K, device, seed=41)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    assert rel_err(g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=cfg), ref) < TOL
    assert rel_err(g.nvfp4_linear(x, swap_nibbles(q), s, gs, out_dtype=torch.float32, config=cfg), ref) > 0.1
    for shift in (1, 16):
        s_shifted = torch.roll(s.view(torch.uint8), shift, dims=1).view(torch.float8_e4m3fn)
        assert rel_err(g.nvfp4_linear(x, q, s_shifted, gs, out_dtype=torch.float32, config=cfg), ref) > 0.1, shift


def test_must_fail_stream_k_with_a_stale_counter(device):
    """A counter not put back is seen: the row block's last arrival is missed and y keeps its poison."""
    M, N, K = 1, 100, 2048
    q, s, gs = _weight(N, K, device, seed=42)
    x = _x(M, K, device, seed=43)
    cfg = dict(STREAM_K=2)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    assert rel_err(g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg),
                   ref) < TOL
    cnt = g._arrival_counters(torch.device(device), 2)
    cnt[0] = 100     # as if earlier calls had left arrivals behind: no arrival is then the last one (with 1 left
    #                  behind, the next-to-last would sum a partial not yet written: right only by the allocator's luck)
    try:
        bad = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
        assert rel_err(bad, ref) > 0.1
    finally:
        cnt.zero_()


@pytest.mark.parametrize("M,N,K,cfg", [(1, 1023, 272, dict(STREAM_K=3)), (1, 100, 2048, dict(STREAM_K=2, X_BUILD=True)),
                                       (8, 37, 1024, dict(STREAM_K=4)), (3, 50, 400, dict(STREAM_K=8, X_BUILD=True)),
                                       (2, 70, 1024, dict(STREAM_K=1, BLOCK_N=32, num_warps=2))])
def test_fp8_stream_k_matches_twin(M, N, K, cfg, device):
    gen = torch.Generator().manual_seed(N + K)
    f, sc = encode_fp8(torch.randn(N, K, generator=gen))
    f, sc = f.to(device), sc.to(device)
    x = _x(M, K, device, seed=M)
    ref = g.fp8_linear_torch(x, f, sc, out_dtype=torch.float32)
    y1 = g.fp8_linear(x, f, sc, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
    assert_close(y1, ref, TOL, f"fp8 STREAM_K {cfg}")
    assert _counters_zero(device)
    y2 = g.fp8_linear(x, f, sc, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
    assert torch.equal(y1, y2)
    flipped = (f.view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)      # the must-fail twin: every sign flipped
    assert rel_err(g.fp8_linear(x, flipped, sc, out_dtype=torch.float32, config=cfg), ref) > 0.1


@pytest.mark.parametrize("total,programs", [(4640, 528), (32768, 528), (64, 1056), (17, 4), (1, 8), (1000, 1)])
def test_stream_k_shares_cover_the_tiles_once(total, programs):
    n, per = g.stream_k_shares(total, programs)
    assert 1 <= n <= programs and per >= 1
    assert (n - 1) * per < total <= n * per        # every program has a tile, no tile is left over
    assert per == -(-total // programs)            # the shares are as even as the tile count allows


_PDL_CASES = [(M, cfg) for M in (1, 3) for cfg in (dict(), dict(STREAM_K=3, SCALE_AHEAD=1),
                                                  dict(SPLIT_K=2, SPLIT_REDUCE=1, X_BUILD=True),
                                                  dict(STREAM_K=2, X_BUILD=True, X_AHEAD=True))]
if not torch.cuda.is_available():
    # the interpreter switches PDL / PREFETCH off, so each case there compares a launch with itself: one case shows
    # the options are accepted (22 s of CI for all eight, H200 runs them all)
    _PDL_CASES = _PDL_CASES[1:2]


@pytest.mark.parametrize("M,cfg", _PDL_CASES)
def test_pdl_changes_no_bit(cfg, M, device):
    """PDL / PREFETCH (launch_pdl, gdc_wait before any read of x, an L2 prefetch of the first weight tile) give the
    same bits as the plain launch; under the interpreter they are switched off (no inline PTX there)."""
    N, K = 1023, 1040
    q, s, gs = _weight(N, K, device, seed=50 + M)
    x = _x(M, K, device, seed=51 + M)
    plain = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
    assert_close(plain, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, f"{cfg}")
    for extra in (dict(PDL=True), dict(PDL=True, PREFETCH=True)):
        y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config={**cfg, **extra})
        assert torch.equal(y, plain), extra
    f, sc = encode_fp8(torch.randn(N, K, generator=torch.Generator().manual_seed(M)))
    f, sc = f.to(device), sc.to(device)
    fcfg = {k: v for k, v in cfg.items() if k in ("STREAM_K", "SPLIT_K", "SPLIT_REDUCE", "X_BUILD")}
    ref = g.fp8_linear(x, f, sc, out_dtype=torch.float32, config=fcfg or None)
    assert torch.equal(g.fp8_linear(x, f, sc, out_dtype=torch.float32, config={**fcfg, "PDL": True, "PREFETCH": True}),
                       ref)


@pytest.mark.parametrize("key", sorted(k for k, c in g.GEMV_CHOICES.items() if c.get("STREAM_K")))
def test_stream_k_choices_run_and_match_twin(key, device):
    """Every STREAM_K entry of GEMV_CHOICES, as pasted, on a small odd shape at its M (one row fewer where M > 1)."""
    _, m_pad, _, _ = key
    M, N, K = max(1, m_pad - 1) if m_pad > 2 else m_pad, 1023, 1040
    q, s, gs = _weight(N, K, device, seed=m_pad)
    x = _x(M, K, device, seed=m_pad + 1)
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=g.GEMV_CHOICES[key])
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, f"{key}")


@pytest.mark.parametrize("key", sorted(g.FP8_GEMV_CHOICES))
def test_fp8_choices_run_and_match_twin(key, device):
    _, m_pad, _, _ = key
    M, N, K = max(1, m_pad - 1) if m_pad > 2 else m_pad, 1023, 1040
    f, sc = encode_fp8(torch.randn(N, K, generator=torch.Generator().manual_seed(m_pad)))
    f, sc = f.to(device), sc.to(device)
    x = _x(M, K, device, seed=m_pad)
    # the entry's tensor-core keys (an 'FMA' key routes M = 1 to the CUDA cores' fp16 math: tests/kernels/
    # test_gemv_fp8_fma.py checks those configurations plan, and the kernel against its twin)
    cfg = {k: v for k, v in g.FP8_GEMV_CHOICES[key].items() if k != "FMA"}
    y = g.fp8_linear(x, f, sc, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
    assert_close(y, g.fp8_linear_torch(x, f, sc, out_dtype=torch.float32), TOL, f"{key}")


def test_fp8_choices_apply_by_shape_and_device(monkeypatch):
    dev = torch.device("cpu")                      # arch 0: the H200's entries do not apply here
    assert "STREAM_K" not in g.fp8_gemv_config(18560, 4096, dev, M=1)
    monkeypatch.setitem(g.FP8_GEMV_CHOICES, (0, 1, 18560, 4096), dict(STREAM_K=4, num_stages=3))
    c = g.fp8_gemv_config(18560, 4096, dev, M=1)
    assert c["STREAM_K"] == 4 and c["num_stages"] == 3
    assert "STREAM_K" not in g.fp8_gemv_config(18560, 4096, dev, M=5)     # M_PAD 8: another entry
    assert g.fp8_gemv_config(18560, 4096, dev, dict(STREAM_K=0), M=1)["STREAM_K"] == 0     # the caller's config wins
