"""The fused decode router (kernels/router.py) against its twin, the math of nemotron.moe.Router: the same experts in
the same order, the weights within fp32 rounding, at odd expert counts and groupings, M = 1 and 3, one router or
two (the guess); ties go to the lower expert index; twins that add the bias after the top-k or drop the group mask
are caught. On CUDA also the prefill GEMM's bf16 path against the fp32 GEMM (skipped on CPU)."""
import pytest
import torch

from kernels import backend, router

CASES = [  # E, H, n_group, topk_group, k, M, routers, gate dtype
    (40, 200, 5, 2, 6, 1, 2, torch.float32),
    (40, 1030, 5, 3, 7, 3, 1, torch.bfloat16),
    (48, 96, 1, 1, 8, 1, 2, torch.bfloat16),
    (24, 1100, 3, 1, 5, 3, 2, torch.float32),
]


def _draw(E, H, R, M, gate_dtype, device, bias_scale=0.3):
    h = torch.randn(M, H, device=device).to(torch.bfloat16 if gate_dtype == torch.bfloat16 else torch.float32)
    gates = [(torch.randn(E, H, device=device) / H ** 0.5).to(gate_dtype) for _ in range(R)]
    biases = [torch.randn(E, device=device) * bias_scale for _ in range(R)]
    return h, gates, biases


def _fused(monkeypatch, *args, **kw):
    monkeypatch.setattr(backend, "FORCED", {"router": "triton"})
    return router.route_rows(*args, **kw)


def assert_same_routing(ex, wt, ref):
    """ex, wt [R, M, k] against ref: per router (experts [M, k], weights [M, k])."""
    for r, (ei, wi) in enumerate(ref):
        assert torch.equal(ex[r].cpu(), ei.cpu()), f"router {r}: experts {ex[r].tolist()} != {ei.tolist()}"
        torch.testing.assert_close(wt[r].cpu(), wi.cpu(), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("E,H,G,TG,k,M,R,dt", CASES)
def test_fused_router_equals_twin(monkeypatch, device, E, H, G, TG, k, M, R, dt):
    h, gates, biases = _draw(E, H, R, M, dt, device)
    cfg = (k, G, TG, True, 2.5)
    ex, wt = _fused(monkeypatch, h, gates, biases, *cfg)
    assert ex.shape == wt.shape == (R, M, k) and ex.dtype == torch.int64 and wt.dtype == torch.float32
    assert_same_routing(ex, wt, [router.route_torch(h, g, b, *cfg) for g, b in zip(gates, biases)])


def test_fused_router_writes_into_given_buffers_unnormalized(monkeypatch, device):
    E, H, k, M, R = 40, 300, 6, 1, 2
    h, gates, biases = _draw(E, H, R, M, torch.float32, device)
    ex = torch.full((R, M, k), -1, dtype=torch.int64, device=device)
    wt = torch.zeros(R, M, k, device=device)
    got = _fused(monkeypatch, h, gates, biases, k, 5, 2, False, 1.5, experts=ex, weights=wt)
    assert got[0] is ex and got[1] is wt
    assert_same_routing(ex, wt, [router.route_torch(h, g, b, k, 5, 2, False, 1.5) for g, b in zip(gates, biases)])


def test_fused_router_ties_go_to_the_lower_index(monkeypatch, device):
    """Experts 3 and 17 (and 9 and 30) have identical gate rows and biases: exactly equal scores. Inside the top-k
    both are chosen (as the twin chooses them); at the boundary (k such that only one of the pair fits) the lower
    index is taken."""
    E, H = 40, 64
    h, (g,), (b,) = _draw(E, H, 1, 1, torch.float32, device, bias_scale=0.0)
    g[17], g[30] = g[3], g[9]
    # make 3/17 the best pair and 9/30 the next pair, everything else below
    lg = (h.float() @ g.T)[0]
    b[:] = -lg.abs().max() * 10
    for i in (3, 17):
        b[i] = 1.0
    for i in (9, 30):
        b[i] = 0.5
    ex, _ = _fused(monkeypatch, h, [g], [b], 3, 1, 1, True, 1.0)
    assert ex[0, 0].tolist() == [3, 17, 9]                 # 9 before 30: the lower index of the tied pair
    ex4, wt4 = _fused(monkeypatch, h, [g], [b], 4, 1, 1, True, 1.0)
    assert ex4[0, 0].tolist() == [3, 17, 9, 30]
    ti, tw = router.route_torch(h, g, b, 4, 1, 1, True, 1.0)
    assert sorted(ti[0].tolist()) == [3, 9, 17, 30]     # the twin's set; torch.topk leaves the order of ties open
    torch.testing.assert_close(wt4[0, 0].sum().cpu(), tw[0].sum().cpu())


def _bias_after_topk(h, g, b, k, G, TG, norm, scaling):
    """Must-fail twin: the bias left out of the choice (selection on the unbiased scores)."""
    return router.select_torch(h.float() @ g.float().T, torch.zeros_like(b), k, G, TG, norm, scaling)


def _no_group_mask(h, g, b, k, G, TG, norm, scaling):
    """Must-fail twin: the group-limited top-k treated as plain top-k."""
    return router.route_torch(h, g, b, k, 1, 1, norm, scaling)


@pytest.mark.parametrize("broken", [_bias_after_topk, _no_group_mask])
def test_broken_router_twins_are_caught(monkeypatch, device, broken):
    E, H, G, TG, k, M = 40, 200, 5, 2, 6, 3
    h, (g,), (b,) = _draw(E, H, 1, M, torch.float32, device, bias_scale=1.0)
    cfg = (k, G, TG, True, 2.5)
    ex, wt = _fused(monkeypatch, h, [g], [b], *cfg)
    assert_same_routing(ex, wt, [router.route_torch(h, g, b, *cfg)])
    with pytest.raises(AssertionError):
        assert_same_routing(ex, wt, [broken(h, g, b, *cfg)])


def test_fused_router_rejects_bad_input(monkeypatch, device):
    h, gates, biases = _draw(40, 64, 1, 1, torch.float32, device)
    with pytest.raises(ValueError, match="at most"):
        _fused(monkeypatch, torch.randn(router.MAX_ROWS + 1, 64, device=device), gates, biases, 4, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="not a valid grouping"):
        _fused(monkeypatch, h, gates, biases, 4, 6, 2, True, 1.0)
    with pytest.raises(ValueError, match="top-30 of 24"):
        _fused(monkeypatch, h, gates, biases, 30, 5, 3, True, 1.0)
    with pytest.raises(ValueError, match="gate"):
        _fused(monkeypatch, h, [gates[0][:, :32]], biases, 4, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="experts out"):
        _fused(monkeypatch, h, gates, biases, 4, 1, 1, True, 1.0, experts=torch.zeros(1, 1, 3, dtype=torch.int64),
               weights=torch.zeros(1, 1, 4))


def _near_tie_rows(logits32, bias, k, tol):
    c = torch.sigmoid(logits32) + bias
    top = c.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) < tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.mm(out_dtype=float32) is CUDA only")
@pytest.mark.parametrize("T", [512, 4000])
def test_bf16_gemm_routes_as_the_fp32_gemm(T):
    """Super's shape: the bf16 tensor-core GEMM with fp32 output (the prefill router where the gate is bf16) chooses
    the fp32 GEMM's experts on every row but near ties (a k-th vs (k+1)-th gap below 1e-5, where the summation
    order decides); the fused decode router does too, on single rows."""
    E, H, k = 512, 4096, 22
    h = (torch.randn(T, H, device="cuda") * 0.5).to(torch.bfloat16)
    g = (torch.randn(E, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    b = torch.randn(E, device="cuda") * 0.05
    l32 = h.float() @ g.float().T
    l16 = torch.mm(h, g.T, out_dtype=torch.float32)
    torch.testing.assert_close(l16, l32, rtol=1e-4, atol=1e-4)
    e32, w32 = router.select_torch(l32, b, k, 1, 1, True, 5.0)
    e16, w16 = router.select_torch(l16, b, k, 1, 1, True, 5.0)
    same = (e32.sort(-1).values == e16.sort(-1).values).all(-1)
    near = _near_tie_rows(l32, b, k, 1e-5)
    assert bool((same | near).all()), f"{int((~same & ~near).sum())} rows routed differently without a near tie"
    ex, wt = router.route_rows(h[:8], [g, g], [b, b], k, 1, 1, True, 5.0)
    for m in range(8):
        if not near[m]:
            assert set(ex[0, m].tolist()) == set(e32[m].tolist()) == set(ex[1, m].tolist())
    torch.testing.assert_close(wt[0], w32[:8], rtol=1e-4, atol=1e-5)
