"""bench/kernels/mamba_ssd.py on the small shape (CPU, Triton interpreted): the checks hold the kernels to the twin
(and catch the one-MMA variant), every row is timed, the JSON is written; and its --sass table for sm_90."""
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.kernels import mamba_ssd

ROOT = Path(__file__).resolve().parents[2]


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


def test_kernels_compile_for_sm90_on_the_tensor_cores():
    """CONFIG's two kernels at Super's blocks, compiled for sm_90 without a GPU: wgmma (HGMMA), no spills. In a
    subprocess: the test session interprets Triton (conftest), and an interpreted kernel cannot be compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-m", "bench.kernels.mamba_ssd", "--sass", "90", "--variants", "ssd"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("ssd")][0]
    state, out = line.split(" out ")
    for part in (state, out):
        assert "'HGMMA'" in part and "'stack': 0" in part, line
