"""The import rules of docs/architecture.md: a library never imports a process package, nor names one (a
`python -m <process package>` in a spawn); procs imports no torch either (cache_shm's own test says so for it)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROCESS_PACKAGES = ("gpu_worker", "server", "prefetcher", "io_workers", "launcher")
LIBRARIES = ("cache_shm", "kernels", "nemotron", "procs", "expert_store")


def violations(source: str) -> list[str]:
    """Imports of process packages, and strings that name one as a module (`io_workers.reader`, `prefetcher`)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in PROCESS_PACKAGES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in PROCESS_PACKAGES:
                out.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a module argument ("io_workers.reader") or a command line ("python -m prefetcher"); prose that
            # mentions the prefetcher is fine
            v = f" {node.value.strip()} "
            if " -m " in v:
                named = (v.split(" -m ", 1)[1].split() or [""])[0]
            elif len(v.split()) == 1:
                named = v.strip()
            else:
                continue
            if named.split(".")[0] in PROCESS_PACKAGES and all(p.isidentifier() for p in named.split(".")):
                out.append(f"names {named!r}")
    return out


@pytest.mark.parametrize("library", LIBRARIES)
def test_libraries_import_and_name_no_process_package(library):
    found = {str(p.relative_to(REPO)): v for p in sorted((REPO / library).rglob("*.py"))
             if (v := violations(p.read_text()))}
    assert found == {}


def test_the_check_catches_an_import_and_a_spawn():
    """The must-fail twin: the supervisor's own source, as it would read inside a library, is caught."""
    src = (REPO / "gpu_worker" / "cache_supervisor.py").read_text()
    assert any("'prefetcher'" in v for v in violations(src))
    assert any("'io_workers.reader'" in v for v in violations(src))
    assert violations("from gpu_worker.engine import StreamingEngine") == ["from gpu_worker.engine import ..."]
    assert violations("import server.app") == ["import server.app"]
    assert violations("cmd = 'python -m gpu_worker.worker --fd 3'") == ["names 'gpu_worker.worker'"]
    assert violations('"""The prefetcher process owns the index."""') == []


def test_procs_imports_no_torch_and_no_process_package():
    code = ("import sys, procs.messages, procs.spawn\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch',) + " + repr(PROCESS_PACKAGES) + "]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
