"""bench.kernels.gemv_nvfp4_sass compiles the decode GEMV as its wrappers launch it (sm_90, no GPU): a kernel
argument added without the probe following would break the NOTES' SASS table; this catches it. In a subprocess:
the test session interprets Triton (conftest), and an interpreted kernel cannot be compiled."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_probe_compiles_and_counts():
    labels = ["m8 M1 BN64 build+last", "fp8 M1 last"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-m", "bench.kernels.gemv_nvfp4_sass", "--only", ",".join(labels)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for label in labels:
        line = [ln for ln in r.stdout.splitlines() if label in ln][0]
        per_weight = float(line.split(label)[1].split()[0])
        assert 2.0 < per_weight < 8.0, line      # experiment 4's range: 2.9-9.4 instructions per weight
