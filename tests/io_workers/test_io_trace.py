"""The IO workers' read trace (cache_shm/io_trace.py): written only when asked for, one record per read with the
prefetcher's dispatch time; and bench.io_trace's account of it over a benchmark's windows, by a hand count."""
from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache_shm"))
from moestream_fake_store import make_fake_store  # noqa: E402

from bench.io_trace import line, summarize  # noqa: E402
from cache_shm.io_trace import ENV, read_trace, trace_path  # noqa: E402
from cache_shm.shm import DEMAND, LOADING, PREFETCH, READY, CacheShm  # noqa: E402
from io_workers import reader  # noqa: E402


@pytest.fixture()
def shm(tmp_path):
    store = make_fake_store(tmp_path / "s", n_layers=2, n_experts=4)
    shm = CacheShm.create(store, n_slots=4, n_workers=1)
    yield shm
    shm.close()


def _worker(shm, chunks=4):
    return reader.Worker(shm, 0, os.getpid(), read_chunks=chunks)


def _close(w):
    if w.pool is not None:
        w.pool.shutdown()
    os.close(w.fd)
    if w.trace is not None:
        w.trace.close()


def _load(shm, w, slot, layer, expert, kind, dispatched):
    shm.slot_gen[slot] = int(shm.slot_gen[slot]) + 1
    shm.slot_state[slot] = LOADING
    w._process(int(shm.slot_gen[slot]), slot, layer, expert, kind, dispatched)


@pytest.mark.parametrize("chunks", [4, 16])
def test_each_read_is_traced_with_its_dispatch_time(shm, tmp_path, monkeypatch, chunks):
    d = tmp_path / "trace"
    d.mkdir()
    monkeypatch.setenv(ENV, str(d))
    w = _worker(shm, chunks)
    try:
        t = time.monotonic_ns()
        _load(shm, w, 0, 1, 2, DEMAND, t)
        _load(shm, w, 1, 0, 3, PREFETCH, t + 5)
    finally:
        _close(w)
    assert shm.slot_state[0] == READY and shm.slot_state[1] == READY
    recs = sorted(read_trace(str(d)), key=lambda r: r[2])
    assert [(r[0], r[1], r[4], r[5], r[6], r[7]) for r in recs] == [(0, t, 1, 2, DEMAND, 1),
                                                                      (0, t + 5, 0, 3, PREFETCH, 1)]
    for r in recs:
        assert t <= r[2] <= r[3] <= time.monotonic_ns()    # dispatched, begun, ended: one clock, in order
    assert stat.S_IMODE(os.stat(trace_path(str(d), 0)).st_mode) == 0o600


def test_no_trace_unless_asked_for(shm, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    w = _worker(shm)
    try:
        assert w.trace is None
        _load(shm, w, 0, 1, 2, DEMAND, 1)
    finally:
        _close(w)
    assert shm.slot_state[0] == READY
    monkeypatch.setenv(ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="missing.*not a directory"):
        _worker(shm)


MS = 1_000_000


def _rec(disp, start, end, kind, ok=1, layer=0, expert=0):
    return (0, disp * MS, start * MS, end * MS, layer, expert, kind, ok)


def test_summary_by_hand():
    recs = [_rec(2, 10, 30, DEMAND), _rec(5, 20, 60, PREFETCH), _rec(50, 80, 120, DEMAND),
            _rec(0, 0, 100, DEMAND, ok=0),        # failed: no bytes, left out
            _rec(150, 200, 300, PREFETCH)]        # outside the window
    s = summarize(recs, [(0, 100 * MS)], block_bytes=1000 * MS)
    assert s["window_ms"] == 100
    assert s["busy_fraction"] == pytest.approx(0.70)          # [10, 60] and [80, 100]
    assert s["mean_in_flight"] == pytest.approx(0.80)         # 20 + 40 + 20 (the third read's part in the window)
    assert s["in_flight_share"]["0"] == pytest.approx(0.3)
    assert s["in_flight_share"]["1"] == pytest.approx(0.6)
    assert s["in_flight_share"]["2"] == pytest.approx(0.1)
    assert s["gbps_while_busy"] == pytest.approx(2500 / 70)    # 1 + 1 + half a block over 70 ms busy
    assert s["gbps_over_windows"] == pytest.approx(25.0)
    assert s["reads_ended"] == 2                               # the third ends after the window
    assert s["demand"]["n"] == 1 and s["demand"]["queued_ms"]["median"] == pytest.approx(8)
    assert s["demand"]["served_ms"]["median"] == pytest.approx(20)
    assert s["prefetch"]["queued_ms"]["median"] == pytest.approx(15)
    assert s["demand"]["served_ms_by_in_flight"] == {"1": 20.0}
    assert s["prefetch"]["served_ms_by_in_flight"] == {"2": 40.0}
    assert "disk busy 0.70" in line(s)
    # the twin: whole reads, not their parts in the window, would count 100 ms of reads in flight, not 80
    whole = sum((r[3] - r[2]) for r in recs[:3]) / (100 * MS)
    assert whole != pytest.approx(s["mean_in_flight"])
    # two windows: the time between them counts for nothing
    s2 = summarize(recs, [(0, 40 * MS), (80 * MS, 100 * MS)], block_bytes=1000 * MS)
    assert s2["window_ms"] == 60 and s2["busy_fraction"] == pytest.approx((30 + 20) / 60)
    with pytest.raises(ValueError, match="overlap"):
        summarize(recs, [(0, 50 * MS), (40 * MS, 60 * MS)], block_bytes=1)


def test_read_chunks_from_the_environment(monkeypatch, tmp_path):
    """The supervisor's workers read a block in MOESTREAM_READ_CHUNKS pieces unless told; bad values are named."""
    from gpu_worker.cache_supervisor import Supervisor
    store = make_fake_store(tmp_path / "s", n_layers=1, n_experts=2)
    monkeypatch.delenv("MOESTREAM_READ_CHUNKS", raising=False)
    assert Supervisor(store, n_slots=2).worker_args[:2] == ("--read-chunks", "4")
    monkeypatch.setenv("MOESTREAM_READ_CHUNKS", "16")
    assert Supervisor(store, n_slots=2).worker_args[:2] == ("--read-chunks", "16")
    assert Supervisor(store, n_slots=2, read_chunks=2).read_chunks == 2      # an argument wins
    monkeypatch.setenv("MOESTREAM_READ_CHUNKS", "0")
    with pytest.raises(ValueError, match="MOESTREAM_READ_CHUNKS='0'"):
        Supervisor(store, n_slots=2)
