"""bench.kernels.jit_host_parts runs (without the interpreter, as it must) and reports every part; it refuses to run
under the interpreter, where @triton.jit builds no JIT function to time. (Timings are the bench's, not asserted.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.gpu_compile import has_cuda_backend

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not has_cuda_backend(), reason="the binder is built for an sm_90 target: Triton's NVIDIA backend")
def test_jit_host_parts_runs_and_adds_up(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "parts.json"
    r = subprocess.run([sys.executable, "-m", "bench.kernels.jit_host_parts", "--calls", "200", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    us = json.loads(out.read_text())["us"]
    assert set(us) == {"binder", "cache key", "knobs", "used globals", "run's Python"}
    assert all(v > 0 for v in us.values())
    assert "| binder |" in r.stdout


def test_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "bench.kernels.jit_host_parts", "--calls", "10"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "without TRITON_INTERPRET" in (r.stdout + r.stderr)
