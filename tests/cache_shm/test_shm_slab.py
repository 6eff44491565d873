"""Slab and control segment: creation, size checks, modes, cleanup, stale sweep."""
import errno
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import cache_shm.shm as shm_mod
from cache_shm.names import list_entries, new_prefix, sweep_stale
from cache_shm.shm import CacheShm, CacheSizeError
from moestream_fake_store import make_fake_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("store"), n_layers=2, n_experts=8)


def test_create_attach_close_unlinks_everything(store):
    shm = CacheShm.create(store, n_slots=5, n_workers=2)
    try:
        entries = shm.entries()
        assert len(entries) == 2 + 2 + 2   # slab, ctl; sem pf, ready; one sem per worker
        for e in entries:
            assert stat.S_IMODE(os.stat(f"/dev/shm/{e}").st_mode) == 0o600, e
        assert shm.slab.ctypes.data % 4096 == 0 and shm.slot_bytes % 4096 == 0
        assert (shm.slot_of_expert == -1).all() and (shm.slot_key == -1).all()
        other = CacheShm.attach(shm.prefix)
        other.slab[3, :4] = [1, 2, 3, 4]
        other.slot_pins[2] = 7
        assert list(shm.slab[3, :4]) == [1, 2, 3, 4] and shm.slot_pins[2] == 7
        assert (other.store_offsets == store.offsets).all()
        assert other.experts_path == os.path.abspath(store.experts_path)
        other.close()
        assert shm.entries() == entries     # an attached process's close unlinks nothing
    finally:
        shm.close()
    assert shm.entries() == []


def test_cache_larger_than_free_shm_is_a_clear_error(store):
    prefix = new_prefix()
    huge = 1 << 50
    with pytest.raises(CacheSizeError, match=r"does not fit in /dev/shm: .* GiB free of") as ei:
        CacheShm.create(store, cache_bytes=huge, n_workers=1, prefix=prefix)
    assert f"{huge // store.block_stride} slots x {store.block_stride} bytes" in str(ei.value)
    assert list_entries(prefix) == []


def test_small_tmpfs_simulated(store, monkeypatch):
    """/dev/shm with 1 MiB free: refused before anything is created."""
    monkeypatch.setattr(shm_mod, "free_shm_bytes", lambda: (1 << 20, 2 << 20))
    prefix = new_prefix()
    with pytest.raises(CacheSizeError, match=r"cache of 1.6 MiB \(100 slots x 16384 bytes\) .* 1.0 MiB free of 2.0 MiB"):
        CacheShm.create(store, n_slots=100, n_workers=1, prefix=prefix)
    assert list_entries(prefix) == []


def test_fallocate_enospc_leaves_nothing(store, monkeypatch):
    """The free-space check passed but the tmpfs filled up meanwhile: posix_fallocate says ENOSPC."""
    def full(fd, off, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    prefix = new_prefix()
    with pytest.raises(CacheSizeError, match=r"cannot reserve the slab of .* MiB in /dev/shm \(/dev/shm is full"):
        CacheShm.create(store, n_slots=4, n_workers=1, prefix=prefix)
    assert list_entries(prefix) == []


def test_sweep_stale_removes_dead_runs_only(store):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = CacheShm.create(store, n_slots=2, n_workers=1, prefix=new_prefix(dead_pid))
    stale.owner = False          # pretend its owner died without cleaning up
    stale.close()
    live = CacheShm.create(store, n_slots=2, n_workers=1)
    try:
        assert list_entries(stale.prefix)
        removed = sweep_stale()
        assert set(list_entries(stale.prefix)).isdisjoint(list_entries()) and list_entries(stale.prefix) == []
        assert len([r for r in removed if r.startswith(stale.prefix.lstrip("/"))
                    or r.startswith("sem." + stale.prefix.lstrip("/"))]) == 5
        assert len(live.entries()) == 5     # ours, alive: untouched
    finally:
        live.close()


def test_stats_names(store):
    with CacheShm.create(store, n_slots=2, n_workers=2) as shm:
        s = shm.stats()
        for k in ("hits", "misses", "prefetch_issued", "prefetch_used", "prefetch_wasted",
                  "io_bytes_read", "demand_queue", "prefetch_queue", "lookups"):
            assert s[k] == 0
        assert len(s["workers"]) == 2
