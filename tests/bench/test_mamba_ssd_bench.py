"""bench/kernels/mamba_ssd.py on the small shape (CPU, Triton interpreted): the checks hold the kernels to the twin
(and catch the one-MMA variant), every row is timed, the JSON is written."""
import json

from bench.kernels import mamba_ssd


def test_small_shape_smoke(tmp_path):
    out = tmp_path / "ms.json"
    res = mamba_ssd.main(["--sizes", "40", "--reps", "1", "--variants", "ssd,nosplit", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == res["rows"]
    c = res["checks"]
    assert c["ssd"]["y_rel_err"] < 3e-5 and c["ssd"]["state_rel_err"] < 3e-5 and c["end_state_rel_err"] < 3e-5
    assert c["nosplit"]["state_rel_err"] > 3e-4
    row = res["rows"][0]
    for k in ("scan_twin_ms", "scan_ssd_ms", "scan_nosplit_ms", "mixer_ssd0_ms", "mixer_ssd1_ms"):
        assert row[k] > 0, k
    assert row["best"] == "ssd" and "saved_per_prompt_ms" in row
