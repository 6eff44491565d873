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
