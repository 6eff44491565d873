"""The staging ring's coalesced copies (gpu_worker/streaming.py `copy_runs`, `_StagingRing.stage`): adjacent slab rows
bound for adjacent ring slots go as one copy of whole rows, anything else one block at a time. On the CPU the runs
themselves (odd patterns: gaps, a ring wrap, another tensor, a short source); the ring's bytes after staging sources
in and out of order, against the sources, on CUDA and on the CPU with the streams and events faked; a twin that
merges across a gap is caught."""
from __future__ import annotations

import pytest
import torch

from gpu_worker import streaming
from gpu_worker.streaming import copy_runs

S = 4096


@pytest.fixture(autouse=True)
def _runs_on(monkeypatch):
    """The runs are off by default (unmeasured): these tests switch them on."""
    monkeypatch.setenv("MOESTREAM_COPY_RUNS", "1")


def _slab(n):
    return torch.randint(0, 255, (n, S), dtype=torch.uint8)


def test_runs_follow_adjacent_rows_and_slots():
    slab, other = _slab(12), _slab(3)
    src = [slab[2], slab[3], slab[4], slab[7], slab[8], other[0], other[1], slab[9], slab[10]]
    slots = [5, 6, 7, 0, 1, 2, 3, 5, 6]          # 7 -> 0: the ring wrapped between rows 4 and 7 anyway
    assert copy_runs(src, slots, S) == [(0, 3), (3, 2), (5, 2), (7, 2)]
    # the same rows into slots that wrap inside a run of rows: cut there
    assert copy_runs([slab[0], slab[1], slab[2]], [6, 7, 0], S) == [(0, 2), (2, 1)]
    # a source shorter than a row (a block view) never joins a run, nor does the row after it
    assert copy_runs([slab[0][:S // 2], slab[1], slab[2]], [0, 1, 2], S) == [(0, 1), (1, 2)]
    assert copy_runs([], [], S) == []


def test_runs_stop_at_a_registered_chunks_end():
    """The slab is registered with CUDA in chunks (cache_shm.cuda_map); a run never spans two."""
    slab = _slab(12)
    base = slab.data_ptr()

    def segment(ptr):
        return (ptr - base) // (4 * S)            # chunks of 4 rows
    src = [slab[r] for r in (2, 3, 4, 5, 6, 7, 8)]
    assert copy_runs(src, list(range(7)), S, segment) == [(0, 2), (2, 4), (6, 1)]
    assert copy_runs(src, list(range(7)), S) == [(0, 7)]      # without it: one run across both boundaries


def _slots_only(sources, slots, stride, segment=None):
    """The must-fail twin: runs that look only at the slots (rows 2 and 5 bound for slots 0 and 1 would merge)."""
    out = []
    for i in range(len(sources)):
        if out and slots[i] == slots[i - 1] + 1:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def test_twin_merging_across_a_gap_is_caught():
    slab = _slab(8)
    src, slots = [slab[2], slab[5]], [0, 1]
    assert copy_runs(src, slots, S) == [(0, 1), (1, 1)]
    assert _slots_only(src, slots, S) != copy_runs(src, slots, S)


ROWS = {"in_order": [3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        "gaps": [0, 1, 3, 4, 5, 9, 10, 12, 14, 2],    # (the twin stays inside the slab: no run past row 15)
        "reversed": [15, 14, 13, 12, 11, 10, 9, 8]}


def _staged_right(order, dev="cuda") -> list[bool]:
    """Each staged block's ring bytes equal to its slab row's, for launches of up to 4 blocks wrapping the ring."""
    dev = torch.device(dev)
    n_slots, bb = 7, S - 100                      # block bytes below the stride, as a store's padding leaves
    slab = _slab(16).pin_memory() if dev.type == "cuda" else _slab(16)
    ring = streaming._StagingRing(n_slots, S, bb, dev)
    rows, seen = ROWS[order], []
    for a in range(0, len(rows), 4):
        part = rows[a:a + 4]
        ptrs = ring.stage([slab[r] for r in part])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        for p, r, slot in zip(ptrs, part, ring.used):
            assert p == ring.buf[slot].data_ptr()
            seen.append(torch.equal(ring.buf[slot, :bb].cpu(), slab[r, :bb]))
        ring.read_by_current_stream()
    return seen


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the staging ring's copy stream and events: CUDA")


@CUDA
@pytest.mark.parametrize("order", list(ROWS))
def test_ring_holds_the_sources(order):
    assert all(_staged_right(order))


@CUDA
def test_ring_twin_merging_across_gaps_is_caught(monkeypatch):
    monkeypatch.setattr(streaming, "copy_runs", _slots_only)
    assert not all(_staged_right("gaps"))


def test_on_by_default_and_zero_copies_block_by_block(monkeypatch):
    slab = _slab(4)
    monkeypatch.delenv("MOESTREAM_COPY_RUNS")
    assert copy_runs([slab[0], slab[1], slab[2]], [0, 1, 2], S) == [(0, 3)]
    monkeypatch.setenv("MOESTREAM_COPY_RUNS", "0")
    assert copy_runs([slab[0], slab[1], slab[2]], [0, 1, 2], S) == [(0, 1), (1, 1), (2, 1)]


class _Event:
    def record(self, stream=None):
        pass


class _Stream:
    def __init__(self, *a):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


@pytest.fixture
def streams_faked(monkeypatch):
    """The ring's streams and events as no-ops, so that its indexing and runs run on CPU tensors (copies at once)."""
    import contextlib
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())


@pytest.mark.parametrize("order", list(ROWS))
def test_ring_holds_the_sources_on_the_cpu(order, streams_faked):
    assert all(_staged_right(order, "cpu"))


def test_ring_twin_merging_across_gaps_is_caught_on_the_cpu(streams_faked, monkeypatch):
    monkeypatch.setattr(streaming, "copy_runs", _slots_only)
    assert not all(_staged_right("gaps", "cpu"))


@CUDA
def test_ring_copies_across_registered_chunks():
    """A host buffer registered in two chunks, as cache_shm.cuda_map registers the slab. The driver refuses one copy
    of rows 2-5 (two in each chunk): that is what the first GPU run of the runs hit (cudaErrorInvalidValue). The
    ring whose runs stop at the chunks' end stages them right in runs; the twin, runs that ignore the chunks, has its
    copy refused, warns and copies block by block (the bytes still right)."""
    import mmap

    from cache_shm.cuda_map import CUDA_HOST_REGISTER_MAPPED, CUDA_HOST_REGISTER_PORTABLE
    dev = torch.device("cuda")
    cudart = torch.cuda.cudart()
    mm = mmap.mmap(-1, 8 * S)
    slab = torch.frombuffer(mm, dtype=torch.uint8).view(8, S)
    slab.copy_(_slab(8))
    base = slab.data_ptr()
    flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
    for off in (0, 4 * S):
        assert int(cudart.cudaHostRegister(base + off, 4 * S, flags)) == 0
    try:
        rows = [2, 3, 4, 5]
        with pytest.raises(RuntimeError):
            torch.empty(4, S, dtype=torch.uint8, device=dev).copy_(slab[2:6], non_blocking=True)
            torch.cuda.synchronize()
        ring = streaming._StagingRing(6, S, S, dev, segment=lambda p: (p - base) // (4 * S))
        ring.stage([slab[r] for r in rows])
        torch.cuda.synchronize()
        assert ring.runs_ok
        assert all(torch.equal(ring.buf[q].cpu(), slab[r]) for q, r in zip(ring.used, rows))
        twin = streaming._StagingRing(6, S, S, dev)          # no segments: one run across the chunks
        with pytest.warns(RuntimeWarning, match="one copy per block"):
            twin.stage([slab[r] for r in rows])
        torch.cuda.synchronize()
        assert not twin.runs_ok
        assert all(torch.equal(twin.buf[q].cpu(), slab[r]) for q, r in zip(twin.used, rows))
    finally:
        for off in (0, 4 * S):
            cudart.cudaHostUnregister(base + off)


def test_copy_rows_one_copy_or_false_with_a_warning():
    """The run copy the staging ring and the copies ahead share (streaming._copy_rows): k adjacent rows in one copy;
    where the host range cannot be copied in one piece it says so once and the caller copies block by block."""
    import types
    import warnings
    from gpu_worker.streaming import _copy_rows
    stride = 64
    slab = torch.arange(6 * stride, dtype=torch.int64).to(torch.uint8).view(6, stride)
    owner = types.SimpleNamespace(buf=torch.zeros(5, stride, dtype=torch.uint8), runs_ok=True)
    assert _copy_rows(owner, 1, 3, slab[2], "test")
    assert torch.equal(owner.buf[1:4], slab[2:5]) and not owner.buf[0].any() and not owner.buf[4].any()
    assert owner.runs_ok
    short = torch.zeros(stride, dtype=torch.uint8)          # one row only: 3 rows past it are out of its storage
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not _copy_rows(owner, 0, 3, short, "test")
    assert not owner.runs_ok and any("adjacent slab rows failed" in str(x.message) for x in w)
