"""Starting a process of this checkout, and tying a child's life to its parent's.

Every process of a run is `python -m <package>` of this checkout: `spawn_module` puts the checkout first on
PYTHONPATH and runs from it, so the child imports the same code as its parent whatever the caller's cwd. The
child calls `die_with_parent` first thing: the kernel sends it SIGTERM when its parent dies (PR_SET_PDEATHSIG),
so a SIGKILLed parent leaves no process behind.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parent.parent)     # where every process package is importable from
_PR_SET_PDEATHSIG = 1


def spawn_module(module: str, args=(), *, new_session: bool = False, pass_fds=(), **popen_kw) -> subprocess.Popen:
    """`python -m module *args` of this checkout. `new_session`: the child leads its own process group, so a
    signal to the caller's terminal group misses it and `os.killpg(child.pid, ...)` reaches it and its children."""
    env = dict(popen_kw.pop("env", None) or os.environ)
    env["PYTHONPATH"] = CHECKOUT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], env=env, cwd=CHECKOUT,
                            start_new_session=new_session, pass_fds=tuple(pass_fds), **popen_kw)


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Ask for SIGTERM when the parent dies. With `parent_pid`, False when the parent is already gone (it died
    before the request took effect, so no signal will come): the caller should exit."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass        # not Linux: the socket's EOF or the parent-pid checks still end the child
    return parent_pid is None or os.getppid() == parent_pid
