"""Snapshot files hold the conversation (issue 16.5): they are private from the first byte (0600 files in a 0700
directory, whatever the umask), a write that fails leaves no temporary file, and temporary files of processes
that are gone are swept at start."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import torch

from gpu_worker.snapshots import SnapshotStore, model_key
from nemotron.mamba import MambaState
from nemotron.model import InferenceState

KEY = model_key("cfg", "fp", torch.float32, "cpu")


def template(numel: int = 64):
    return InferenceState([MambaState(torch.zeros(2, numel), torch.zeros(2, 4))], 0)


def state(n_tokens: int, numel: int = 64):
    s = template(numel)
    s.layers[0].conv.normal_()
    s.position = n_tokens
    return s


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_snapshot_files_are_private_from_creation_even_under_umask_0(tmp_path, monkeypatch):
    seen = {}
    real_replace = os.replace

    def replace(src, dst):              # the temporary file's mode just before it becomes the snapshot
        seen[str(dst)] = mode(src)
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    old = os.umask(0)
    try:
        d = tmp_path / "var" / "snaps"
        s = SnapshotStore(KEY, template, "cpu", directory=d)
        s.put([5, 6, 7], state(3))
        s.flush()
        s.close()
    finally:
        os.umask(old)
    files = list(d.glob("*.snap"))
    assert len(files) == 1 and seen, (files, seen)
    assert mode(d) == 0o700 and mode(files[0]) == 0o600, (oct(mode(d)), oct(mode(files[0])))
    assert set(seen.values()) == {0o600}, seen            # private before the rename, not chmod-ed after


def test_an_existing_open_directory_is_made_private(tmp_path):
    d = tmp_path / "snaps"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    logged = []
    SnapshotStore(KEY, template, "cpu", directory=d, log=logged.append).close()
    assert mode(d) == 0o700 and any("0700" in m for m in logged)


FAILING_WRITE = textwrap.dedent("""
    import resource, signal, sys, torch
    from gpu_worker.snapshots import SnapshotStore
    sys.path.insert(0, {tests!r})
    from test_reliability_snapshots import KEY, state, template
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)        # writes past the limit fail with EFBIG instead
    s = SnapshotStore(KEY, lambda: template(1 << 16), "cpu", directory={d!r}, log=print)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    s.put([1, 2, 3], state(3, 1 << 16))                  # ~1 MB: the write fails part way, as on a full disk
    s.flush()
    s.close()
    print("written", s.info()["written"])
""")


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    """A disk that fills mid-write (here a file-size limit stands in for ENOSPC: the same failed write(2))."""
    d = tmp_path / "snaps"
    r = subprocess.run([sys.executable, "-c", FAILING_WRITE.format(tests=os.path.dirname(__file__), d=str(d))],
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr
    assert "could not write" in r.stdout and "written 0" in r.stdout, r.stdout
    assert sorted(p.name for p in d.iterdir()) == [], list(d.iterdir())


def test_stale_temporary_files_are_swept_at_start(tmp_path):
    d = tmp_path / "snaps"
    d.mkdir(mode=0o700)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (d / f"{'a' * 40}.snap.tmp{dead.pid}").write_bytes(b"half a snapshot")
        (d / f"{'b' * 40}.tmp{dead.pid}").write_bytes(b"the older naming")
        (d / f"{'c' * 40}.snap.tmp{live.pid}").write_bytes(b"another server's write in progress")
        SnapshotStore(KEY, template, "cpu", directory=d).close()
        assert sorted(p.name for p in d.iterdir()) == [f"{'c' * 40}.snap.tmp{live.pid}"]   # the live one stays
    finally:
        live.kill()
        live.wait()
