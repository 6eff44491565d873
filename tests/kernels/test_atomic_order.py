"""The prefill's down launches accumulate with relaxed atomics: compiled for sm_90 (no GPU needed; Triton's bundled
ptxas and cuobjdump), their epilogue has no GPU-scope memory barrier and no L1 invalidate, where Triton's default
(acq_rel) puts one of each before every vector atomic (bench/NOTES.md, session 16)."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import expert_prefill as ep

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sass_counts() -> dict:
    """{(kernel, sem): Counter of ATOMG / REDG / MEMBAR.<scope> / CCTL}, from bench.kernels.sass_probe --atomics
    run outside Triton's interpreter (which has no compiler: its kernels are Python)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "bench.kernels.sass_probe", "--atomics"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = {}
    for line in out.stdout.splitlines():
        head, _, body = line.partition(": ")
        name, _, sem = head.partition(" sem=")
        counts[(name, sem)] = ast.literal_eval(body)
    return counts


def _barriered(c: dict) -> bool:
    return c.get("MEMBAR.ALL.GPU", 0) > 0 or c.get("CCTL", 0) > 0 or c.get("ATOMG", 0) > 0


@pytest.mark.parametrize("kernel", ["_dense_down_kernel", "_grouped_down_kernel"])
def test_the_engines_down_epilogue_has_no_gpu_barrier(sass_counts, kernel):
    got = sass_counts[(kernel, ep.atomic_sem())]
    assert got.get("REDG", 0) == 16, got          # a 128 x 128 fp32 tile over 256 threads: 16 x v4 each
    assert not _barriered(got), got


@pytest.mark.parametrize("kernel", ["_dense_down_kernel", "_grouped_down_kernel"])
def test_must_fail_twin_the_default_semantics_are_caught(sass_counts, kernel):
    assert _barriered(sass_counts[(kernel, "acq_rel")])


def test_the_knob_takes_the_two_semantics_only(monkeypatch):
    assert ep.atomic_sem() == "relaxed"
    monkeypatch.setenv(ep.ATOMIC_SEM_ENV, "acq_rel")
    assert ep.atomic_sem() == "acq_rel"
    monkeypatch.setenv(ep.ATOMIC_SEM_ENV, "seq_cst")
    with pytest.raises(ValueError, match="MOESTREAM_PREFILL_ATOMIC_SEM"):
        ep.atomic_sem()
