"""Start-up errors are one line and exit status 2, before anything loads: a port already in use, --device cuda
without a GPU, a --max-tokens-default below 1. Each with a twin that gets past the check."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launcher.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def one_error_line(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_a_port_in_use_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        one_error_line(launch("--port", str(port), "--model", str(tmp_path)), "is in use")
    # the twin: the port free again, the launcher gets past it (to the next check: no checkpoint there)
    one_error_line(launch("--port", str(port), "--model", str(tmp_path)), "not a checkpoint directory")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    one_error_line(launch("--device", "cuda", "--port", "0", "--model", str(tmp_path)), "no CUDA GPU")
    one_error_line(launch("--device", "cpu", "--port", "0", "--model", str(tmp_path)), "not a checkpoint directory")


def test_max_tokens_default_below_one_is_refused(tmp_path):
    one_error_line(launch("--max-tokens-default", "0", "--port", "0", "--model", str(tmp_path)),
                   "--max-tokens-default")
