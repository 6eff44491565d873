"""bench.kernels.gemv_streamk_sweep and gemv_pdl_sweep end to end on the CPU (Triton interpreted, tiny shapes): every
variant checked against the twin, the must-fail twins run and caught, the JSON complete."""
import json

from bench.kernels import gemv_pdl_sweep, gemv_streamk_sweep


def test_streamk_sweep_smoke(tmp_path):
    out = tmp_path / "sk.json"
    assert gemv_streamk_sweep.main(["--only", "odd", "--passes", "nvfp4:1,fp8:1,bf16:1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["complete"] and all(c["ok"] for c in r["checks"])
    labels = {row["variant"] for row in r["rows"] if row["family"] == "nvfp4"}
    assert labels == set(gemv_streamk_sweep.nvfp4_variants(1, 37, 272)), labels
    must_fail = [c for c in r["checks"] if c["check"].startswith("must-fail")]
    assert len(must_fail) == 2 and all(c["rel_err"] > 0.1 for c in must_fail)
    assert {row["family"] for row in r["rows"]} == {"nvfp4", "fp8", "bf16"}


def test_pdl_sweep_smoke(tmp_path):
    out = tmp_path / "pdl.json"
    assert gemv_pdl_sweep.main(["--only", "odd", "--passes", "nvfp4:1,fp8:1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["complete"] and all(c["ok"] for c in r["checks"])
    assert {row["variant"] for row in r["rows"]} == {"today", "today pdl", "today pdl pf"}
    assert all(row["us_after_producer"] == row["us_after_producer"] for row in r["rows"])      # not NaN


def test_run1_best_configs_are_sweep_variants():
    """RUN1_BEST holds configurations the first sweep timed (a typo would time something else)."""
    for (fam, _, M), (label, cfg) in gemv_pdl_sweep.RUN1_BEST.items():
        assert cfg.get("STREAM_K"), (fam, label)
        if fam == "nvfp4":
            assert label.startswith("sk")
