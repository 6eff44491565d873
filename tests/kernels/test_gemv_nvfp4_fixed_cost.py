"""The NVFP4 GEMV without its fixed cost per call (issue 19, part 1): B built in the kernel (X_BUILD), split-K
reduced by the last split to arrive (SPLIT_REDUCE 1), x operands shared between GEMVs (xb), the split rule.
Each against the PyTorch twin on odd shapes (N not a multiple of BLOCK_N, K a multiple of 16 but not of BLOCK_K),
each with a must-fail twin."""
import pytest
import torch

from gemv_cases import activations as _x, counters_zero as _counters_zero, poisoned as _poisoned, weight as _weight
from kernels import gemv_nvfp4 as g
from kernels.nvfp4 import swap_nibbles
from kernels.testing import assert_close, rel_err

TOL = 2e-5


# (M, N, K, mode): N = 1,023 is not a multiple of any BLOCK_N; K = 272 = 17 groups, 1 + 1/16 K-tiles of 256
BUILD_CASES = [(1, 1023, 272, 8), (2, 50, 272, 8), (3, 37, 96, 8), (1, 37, 272, 9), (5, 19, 48, 9), (8, 24, 512, 9)]


@pytest.mark.parametrize("M,N,K,mode", BUILD_CASES)
def test_b_built_in_the_kernel_matches_twin(M, N, K, mode, device):
    q, s, gs = _weight(N, K, device, seed=N + K)
    x = _x(M, K, device, seed=M)
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device),
                       config=dict(LOAD_MODE=mode, SPLIT_K=1, X_BUILD=True))
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, f"X_BUILD mode {mode}")


@pytest.mark.parametrize("M,N,K,split", [(1, 1023, 272, 1), (2, 50, 96, 1), (3, 37, 512, 3), (4, 21, 1024, 2)])
def test_one_dot_per_tile_matches_twin(M, N, K, split, device):
    """Mode 8 with the four J tiles joined into k order, B prepared (k-order gather) or built from x."""
    q, s, gs = _weight(N, K, device, seed=7 + M)
    x = _x(M, K, device, seed=8 + M)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    for build in (False, True):
        cfg = dict(LOAD_MODE=8, SPLIT_K=split, SPLIT_REDUCE=1, ONE_DOT=True, X_BUILD=build)
        y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
        assert_close(y, ref, TOL, f"ONE_DOT build={build}")
    assert rel_err(g.nvfp4_linear(x, swap_nibbles(q), s, gs, out_dtype=torch.float32, config=cfg), ref) > 0.1
    with pytest.raises(ValueError, match="ONE_DOT"):
        g.nvfp4_linear(x, q, s, gs, config=dict(LOAD_MODE=9, ONE_DOT=True))


@pytest.mark.parametrize("mode,m_pad", [(8, 1), (8, 2), (8, 4), (9, 1), (9, 4), (9, 8)])
def test_x_pattern_is_where_the_prepared_operands_put_x(mode, m_pad, device):
    """The 0/1 pattern of X_BUILD marks exactly the entries `_x_operands_kernel` fills from x."""
    block_k = 256 // m_pad if mode == 8 else 256
    x = torch.ones(m_pad, block_k, device=device)
    filled = (g.x_operands(x, m_pad, mode == 8).float() != 0)        # [4, Q, 16], the same for every J
    pat = g.x_pattern(torch.device(device), m_pad, mode == 8, block_k).float().cpu()
    for J in range(4):
        assert torch.equal(filled[J].cpu(), pat == 1), J
    assert set(pat.unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("mode", [8, 9])
def test_must_fail_a_shifted_pattern(mode, device, monkeypatch):
    """A wrong pattern is caught: mode 8 one column off (x in the next 16-group's column, scaled by its scale);
    mode 9 with every column of a row's block set (x counted 16 / M_PAD times: there the pattern only picks one
    column per block, and a shift inside the block is summed away, rightly)."""
    M, N, K = (1, 40, 256) if mode == 8 else (3, 40, 256)
    q, s, gs = _weight(N, K, device, seed=3)
    x = _x(M, K, device, seed=4)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    cfg = dict(LOAD_MODE=mode, SPLIT_K=1, X_BUILD=True)
    assert rel_err(g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=cfg), ref) < TOL
    m_pad = 1 if mode == 8 else 4
    # the kernel keys its pattern by the tensors' device (cuda:0), not by the fixture's name ("cuda": index None,
    # which patched an entry the kernel never reads, so this twin passed on the H200)
    key = (x.device.type, x.device.index, m_pad, mode == 8, 256 // m_pad if mode == 8 else 256)
    p = g._patterns[key]
    monkeypatch.setitem(g._patterns, key, torch.roll(p, 1, dims=1) if mode == 8 else torch.ones_like(p))
    assert rel_err(g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=cfg), ref) > 0.1


# split 3 of K = 272 (2 tiles): the third split has no tile and still arrives; split 5 of 1,024 (4 tiles) likewise
@pytest.mark.parametrize("M,N,K,split,mode,build", [(1, 37, 272, 3, 8, False), (2, 50, 1024, 5, 8, True),
                                                    (1, 1023, 512, 2, 8, True), (4, 21, 1024, 3, 9, False),
                                                    (7, 21, 272, 2, 9, True)])
def test_split_reduced_by_the_last_arrival_matches_twin(M, N, K, split, mode, build, device):
    q, s, gs = _weight(N, K, device, seed=split)
    x = _x(M, K, device, seed=N)
    cfg = dict(LOAD_MODE=mode, SPLIT_K=split, SPLIT_REDUCE=1, X_BUILD=build, BLOCK_N=16 if N < 64 else 64)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    y1 = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
    assert_close(y1, ref, TOL, f"split {split} reduced by the last arrival")
    assert _counters_zero(device), "arrival counters left non-zero for the next call"
    y2 = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device), config=cfg)
    assert torch.equal(y1, y2), "the partials are summed in split order: the same bits every call"


def test_split_reduced_stores_the_output_dtype(device):
    """bf16 y straight from the last arrival (no fp32 buffer and cast)."""
    q, s, gs = _weight(45, 1024, device, seed=11)
    x = _x(1, 1024, device, seed=12)
    y = g.nvfp4_linear(x, q, s, gs, config=dict(SPLIT_K=4, SPLIT_REDUCE=1, X_BUILD=True, BLOCK_N=16))
    assert y.dtype == torch.bfloat16 and y.shape == (1, 45)
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), 5e-3, "bf16 out")  # bf16 rounding


def test_must_fail_split_reduce_with_a_stale_counter(device):
    """The check sees a counter that was not put back: no split is then last, y keeps its poison."""
    M, N, K = 1, 30, 1024
    q, s, gs = _weight(N, K, device, seed=5)
    x = _x(M, K, device, seed=6)
    cfg = dict(SPLIT_K=4, SPLIT_REDUCE=1, BLOCK_N=16)
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


@pytest.mark.parametrize("cfg", [dict(X_BUILD=True, SPLIT_REDUCE=1), dict(SPLIT_REDUCE=1)])
def test_must_fail_swapped_nibbles_and_shifted_scales(cfg, device):
    q, s, gs = _weight(40, 1024, device, seed=9)
    x = _x(1, 1024, device, seed=10)
    cfg = dict(cfg, SPLIT_K=3, BLOCK_N=16)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    assert rel_err(g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=cfg), ref) < TOL
    assert rel_err(g.nvfp4_linear(x, swap_nibbles(q), s, gs, out_dtype=torch.float32, config=cfg), ref) > 0.1
    s_shifted = torch.roll(s.view(torch.uint8), 1, dims=1).view(torch.float8_e4m3fn)
    assert rel_err(g.nvfp4_linear(x, q, s_shifted, gs, out_dtype=torch.float32, config=cfg), ref) > 0.1


@pytest.mark.parametrize("M", [1, 3])
def test_x_operands_shared_by_two_gemvs(M, device):
    """k and v (or the shared up and fc1) from one prepared x: the same y as each preparing its own."""
    K = 272
    x = _x(M, K, device, seed=13)
    cfg = g.gemv_config(M, 50, K, torch.device(device))
    xb = g.x_operands(x, cfg["M_PAD"], cfg["LOAD_MODE"] == 8)
    for N in (50, 37):
        q, s, gs = _weight(N, K, device, seed=N)
        y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, xb=xb)
        assert torch.equal(y, g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32))
        assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, "shared xb")


def test_x_operands_of_another_x_are_caught(device):
    """Must-fail twin of sharing: operands of a different x give a different y."""
    q, s, gs = _weight(40, 256, device, seed=14)
    x = _x(1, 256, device, seed=15)
    other = g.x_operands(_x(1, 256, device, seed=16), 1, True)
    assert rel_err(g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, xb=other),
                   g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)) > 0.1


def test_bad_x_operands_are_refused(device):
    q, s, gs = _weight(16, 256, device, seed=17)
    x = _x(1, 256, device, seed=18)
    with pytest.raises(ValueError, match="prepared x operands must be fp16"):
        g.nvfp4_linear(x, q, s, gs, xb=torch.zeros(4, 32, 16, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="reads x itself"):
        g.nvfp4_linear(x, q, s, gs, xb=g.x_operands(x, 1, True), config=dict(X_BUILD=True))


def test_split_rule_defaults_are_experiment_4s():
    """split_k_for with its defaults is the rule gemv_config had (the sweep's baseline must not move)."""
    for N in (256, 1024, 4096, 5376, 18560, 131072):
        for K in (1024, 4096, 5376, 8192):
            for bn in (64, 128):
                n_blocks = -(-N // bn)
                old = 1 if n_blocks >= 264 else max(1, min(-(-264 // n_blocks), K // 1024))
                assert g.split_k_for(N, K, bn, 256, 132) == old, (N, K, bn)


def test_even_splits_leave_no_split_without_a_tile():
    for K in (1024, 4096, 5376, 8192, 272):
        tiles = -(-K // 256)
        for N in (256, 1024, 4096):
            split = g.split_k_for(N, K, 64, 256, 132, programs_per_sm=4, min_tiles=1, even=True)
            per = -(-tiles // split)
            assert (split - 1) * per < tiles, (N, K, split)      # the last split starts inside K
            assert split <= tiles


def test_gemv_choices_override_the_rule(monkeypatch):
    dev = torch.device("cpu")
    base = g.gemv_config(1, 4096, 8192, dev, n_sm=132)
    assert base["SPLIT_K"] == 5 and "X_BUILD" not in base
    monkeypatch.setitem(g.GEMV_CHOICES, (0, 1, 4096, 8192), dict(X_BUILD=True, SPLIT_REDUCE=1, SPLIT_K=8))
    monkeypatch.setitem(g.GEMV_CHOICES, (90, 2, 4096, 8192), dict(X_BUILD=True))   # another GPU's winner
    c = g.gemv_config(1, 4096, 8192, dev, n_sm=132)
    assert c["X_BUILD"] and c["SPLIT_REDUCE"] == 1 and c["SPLIT_K"] == 8
    assert "X_BUILD" not in g.gemv_config(2, 4096, 8192, dev, n_sm=132)     # not this device's, not applied


def test_gemv_choice_runs_through_nvfp4_linear(monkeypatch, device):
    """A pasted choice reaches the kernel: the call then matches the twin and leaves the counters at zero."""
    M, N, K = 1, 37, 1024
    q, s, gs = _weight(N, K, device, seed=19)
    x = _x(M, K, device, seed=20)
    monkeypatch.setitem(g.GEMV_CHOICES, (g._arch(torch.device(device)), 1, N, K),
                        dict(X_BUILD=True, SPLIT_REDUCE=1, SPLIT_K=4, BLOCK_N=16))
    used = []
    real_pattern, real_counters = g.x_pattern, g._arrival_counters
    monkeypatch.setattr(g, "x_pattern", lambda *a: used.append("X_BUILD") or real_pattern(*a))
    monkeypatch.setattr(g, "_arrival_counters", lambda *a: used.append("SPLIT_REDUCE") or real_counters(*a))
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, out=_poisoned(M, N, device))
    assert used == ["X_BUILD", "SPLIT_REDUCE"], used
    assert_close(y, g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32), TOL, "GEMV_CHOICES")
    assert _counters_zero(device)


# ---- the FP8 decode kernel's two flags -------------------------------------------------------------------------

@pytest.mark.parametrize("M,N,K,cfg", [(1, 1023, 272, dict(X_BUILD=True)), (6, 20, 272, dict(X_BUILD=True)),
                                       (1, 45, 1024, dict(SPLIT_K=3, SPLIT_REDUCE=1, BLOCK_K=64)),
                                       (3, 45, 1000, dict(SPLIT_K=3, SPLIT_REDUCE=1, BLOCK_K=64, X_BUILD=True)),
                                       (1, 37, 1024, dict(SPLIT_K=5, SPLIT_REDUCE=1, BLOCK_N=16, X_BUILD=True))])
def test_fp8_gemv_flags_match_twin(M, N, K, cfg, device):
    from kernels.nvfp4 import encode_fp8
    gen = torch.Generator().manual_seed(N + K)
    f, sc = encode_fp8(torch.randn(N, K, generator=gen))
    f, sc = f.to(device), sc.to(device)
    x = _x(M, K, device, seed=M + 30)
    ref = g.fp8_linear_torch(x, f, sc, out_dtype=torch.float32)
    y = g.fp8_linear(x, f, sc, out_dtype=torch.float32, config=cfg, out=_poisoned(M, N, device))
    assert_close(y, ref, TOL, f"fp8 {cfg}")
    assert _counters_zero(device)
    flipped = (f.view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)        # must-fail twin: every sign flipped
    assert rel_err(g.fp8_linear(x, flipped, sc, out_dtype=torch.float32, config=cfg), ref) > 0.1
