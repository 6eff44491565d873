"""Shared fixtures: synthetic checkpoints written once per test session by tools.synth."""
from __future__ import annotations

import os

import torch

# Triton kernels run under the interpreter when there is no GPU. This must be set before any module that
# defines a kernel is imported, and modules of several test folders import kernels — so here, at the root.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
_made: dict[tuple, Path] = {}


def pytest_configure(config):
    """MOESTREAM_CAPTURE_LAUNCHES=F (CI's .ci/run): every kernel launch the interpreter runs is recorded, and written
    to F at the end, for `tools.gpu_compile --compile-from F` to compile each variant as the GPU's JIT would."""
    path = os.environ.get("MOESTREAM_CAPTURE_LAUNCHES")
    if path and os.environ.get("TRITON_INTERPRET") == "1":
        from tools.gpu_compile import Capture
        capture = Capture()
        capture.start()
        config._moestream_launches = (capture, Path(path))


def pytest_unconfigure(config):
    recorded = getattr(config, "_moestream_launches", None)
    if recorded is not None:
        import json
        capture, path = recorded
        capture.stop()
        path.write_text(json.dumps(capture.result()))


def repo_env() -> dict:
    """The environment for a child Python that must import the repository: its root first on PYTHONPATH, what was
    there kept (on the GPU machine, gpu_session.sh's packages live on PYTHONPATH; replacing it lost posix_ipc)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def write_synth(base: Path, preset: str = "tiny", quant: str = "nvfp4", seed: int = 0, *extra: str) -> Path:
    key = (preset, quant, seed, extra)
    if key not in _made:
        out = base / f"{preset}-{quant}-{seed}-{abs(hash(extra)) % 10**8}"
        if not (out / "config.json").exists():
            cmd = [sys.executable, "-m", "tools.synth", "--preset", preset, "--quant", quant, "--seed", str(seed),
                   "--out", str(out), *extra]
            env = repo_env()
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}"
        _made[key] = out
    return _made[key]


@pytest.fixture(scope="session")
def synth(tmp_path_factory):
    base = tmp_path_factory.mktemp("synth")
    return lambda *a, **k: write_synth(base, *a, **k)


def copy_with_swapped_nibbles(src: Path, dst: Path) -> Path:
    """The must-fail twin of an NVFP4 checkpoint: every packed byte with its two 4-bit halves exchanged."""
    from kernels.nvfp4 import swap_nibbles
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, t in tensors.items():
            if t.dtype == torch.uint8 and name.endswith(".weight"):
                tensors[name] = swap_nibbles(t)
        save_file(tensors, shard, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Whatever the tests start in this process (caches, supervisors, engines) unlinks its shared memory: at the
    end of the session none named for this process is left in /dev/shm."""
    yield
    mine = sorted(p.name for p in Path("/dev/shm").glob(f"*moestream-{os.getpid()}-*"))
    for name in mine:                    # clean up first, so that one leak does not spill into the next run
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    assert mine == [], f"shared memory left behind by this test session: {mine}"
