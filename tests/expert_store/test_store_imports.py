"""Import rules: the store is a library (no process package), and its reader needs no torch, so a process
without torch (the IO workers, a tool that only reads a manifest) can open a store."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROCESS_PACKAGES = ("prefetcher", "io_workers", "gpu_worker", "server", "launcher", "tools")


def _imported(modules: str) -> list[str]:
    code = (f"import sys, {modules}\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    return subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True,
                          text=True).stdout.split()


def test_store_reader_imports_no_torch_and_no_process_package():
    top = _imported("expert_store, expert_store.format, expert_store.layout, expert_store.reader")
    assert "torch" not in top
    assert not set(top) & set(PROCESS_PACKAGES)


def test_store_writer_and_verify_import_no_process_package():
    top = _imported("expert_store.writer, expert_store.verify, expert_store.source, expert_store.journal")
    assert not set(top) & set(PROCESS_PACKAGES)


def test_io_worker_imports_no_torch():
    assert "torch" not in _imported("io_workers.reader")


def test_the_check_sees_a_torch_import():
    """must-fail twin: the same check on a module that does import torch reports it"""
    assert "torch" in _imported("expert_store.reader, kernels.expert_prefill")
