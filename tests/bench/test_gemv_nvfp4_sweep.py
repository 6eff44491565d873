"""bench.kernels.gemv_nvfp4_sweep end to end on the CPU (Triton interpreted, tiny shapes): every variant is checked
against the twin, the must-fail twin is shown to fail, the winners come out as GEMV_CHOICES, and the counts that
NOTES quotes are what gemv_config plans for the H200."""
import json

from bench.kernels import gemv_nvfp4_sweep as sweep


def test_sweep_smoke_checks_every_variant(tmp_path):
    out = tmp_path / "gemv.json"
    assert sweep.main(["--only", "latent-like", "--m", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    labels = {row["variant"] for row in r["rows"]}
    assert labels == set(sweep.variants(1, 24, 1024, 4)), labels
    assert all(c["ok"] for c in r["checks"])
    must_fail = [c for c in r["checks"] if c["check"].startswith("must-fail")]
    assert len(must_fail) == 1 and must_fail[0]["rel_err"] > 0.1
    assert r["complete"] and r["rows"][0]["us"] > 0


def test_counts_name_the_launches_of_each_call():
    rows = {(r["shape"], r["M"]): r for r in sweep.counts(sweep.SHAPES, 132)}
    inp, out, fc2 = rows[("mamba.in_proj", 1)], rows[("mamba.out_proj", 1)], rows[("fc2_latent", 1)]
    assert (inp["programs"], inp["split"], inp["tiles_per_program"], inp["launches"]) == (290, 1, 16, 2)
    assert (out["programs"], out["split"], out["tiles_per_program"], out["launches"]) == (320, 5, 7, 4)
    assert (fc2["programs"], fc2["split"], fc2["launches"]) == (64, 1, 2)
    assert sweep.launches(dict(SPLIT_K=4, X_BUILD=True, SPLIT_REDUCE=1)) == 1
    assert sweep.launches(dict(SPLIT_K=4)) == 4


def test_sweep_fp8_smoke(tmp_path):
    out = tmp_path / "fp8.json"
    assert sweep.main(["--fp8", "--only", "latent-like", "--m", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert {row["variant"] for row in r["rows"]} == set(sweep.Fp8.variants(1, 24, 1024, 4))
    assert all(c["ok"] for c in r["checks"]) and all(row["op"] == "fp8 gemv" for row in r["rows"])


def test_x_given_runs_where_the_default_builds_x(monkeypatch):
    """Session 32's H100 sweep: the shapes whose default configuration builds x in the kernel (X_BUILD, GEMV_CHOICES on
    sm_90) failed their "x given" row (prepared operands handed to a kernel that reads x itself). The variant now asks
    for the configuration that reads them: it equals the twin. The twin of the fix (the variant's old config, the
    default's X_BUILD left in) still raises, so the check would have caught it."""
    import pytest
    import torch

    from kernels import gemv_nvfp4 as gk
    real = gk.gemv_config
    monkeypatch.setattr(gk, "gemv_config", lambda *a, **k: dict(real(*a, **k), X_BUILD=True))
    monkeypatch.setattr(sweep, "gemv_config", gk.gemv_config)
    M, N, K = 1, 24, 1024
    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    q, s, gs = sweep._weights(N, K, 1, seed=5)[0]
    y = sweep._fn(dict(XB=True), M, N, K, x)(q, s, gs)
    ref = sweep._fn({}, M, N, K, x)(q, s, gs)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    r = sweep.resolved(dict(XB=True), M, N, K)
    xb = gk.x_operands(x, r["M_PAD"], r["LOAD_MODE"] == 8)
    with pytest.raises(ValueError, match="reads x itself"):
        gk.nvfp4_linear(x, q, s, gs, config={"FMA": None}, xb=xb)
