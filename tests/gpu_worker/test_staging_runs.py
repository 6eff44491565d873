"""The staging ring's coalesced copies (gpu_worker/slab_copies.py `copy_runs`, `SlabRows`, `StagingRing.stage`):
adjacent slab slots bound for adjacent ring slots go as one copy of whole rows, anything else one block at a time.
On the CPU the runs themselves (odd patterns: gaps, a ring wrap, a registration's end); the ring's bytes after
staging slab slots in and out of order, against the slab, on CUDA (by the driver, on the blocks' addresses) and on
the CPU with the streams and events faked; a twin that merges across a gap is caught."""
from __future__ import annotations

import warnings

import pytest
import torch

from gpu_worker import slab_copies
from gpu_worker.slab_copies import SlabRows, copy_runs

S = 4096


@pytest.fixture(autouse=True)
def _runs_on(monkeypatch):
    """The runs are on by default; a developer's MOESTREAM_COPY_RUNS=0 must not change these tests."""
    monkeypatch.setenv("MOESTREAM_COPY_RUNS", "1")


def _slab(n):
    return torch.randint(0, 255, (n, S), dtype=torch.uint8)


def test_runs_follow_adjacent_slab_slots_and_ring_slots():
    slab_slots = [2, 3, 4, 7, 8, 20, 21, 9, 10]
    ring_slots = [5, 6, 7, 0, 1, 2, 3, 5, 6]      # 7 -> 0: the ring wrapped between slots 4 and 7 anyway
    assert copy_runs(slab_slots, ring_slots) == [(0, 3), (3, 2), (5, 2), (7, 2)]
    # the same slab slots into ring slots that wrap inside a run: cut there
    assert copy_runs([0, 1, 2], [6, 7, 0]) == [(0, 2), (2, 1)]
    assert copy_runs([5, 4, 3], [0, 1, 2]) == [(0, 1), (1, 1), (2, 1)]        # descending: no run
    assert copy_runs([], []) == []


def test_runs_stop_at_a_registered_chunks_end():
    """The slab is registered with CUDA in chunks of whole slots (cache_shm.cuda_map); a run never spans two."""
    slots = [2, 3, 4, 5, 6, 7, 8]
    assert copy_runs(slots, list(range(7)), chunk=4) == [(0, 2), (2, 4), (6, 1)]
    assert copy_runs(slots, list(range(7))) == [(0, 7)]      # without it: one run across both boundaries


def _slots_only(slab_slots, ring_slots, chunk=None):
    """The must-fail twin: runs that look only at the ring slots (slab slots 2 and 5 bound for 0 and 1 would merge)."""
    out = []
    for i in range(len(slab_slots)):
        if out and ring_slots[i] == ring_slots[i - 1] + 1:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def test_twin_merging_across_a_gap_is_caught():
    assert copy_runs([2, 5], [0, 1]) == [(0, 1), (1, 1)]
    assert _slots_only([2, 5], [0, 1]) != copy_runs([2, 5], [0, 1])


ROWS = {"in_order": [3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        "gaps": [0, 1, 3, 4, 5, 9, 10, 12, 14, 2],    # (the twin stays inside the slab: no run past row 15)
        "reversed": [15, 14, 13, 12, 11, 10, 9, 8]}


def _staged_right(order, dev="cuda") -> list[bool]:
    """Each staged block's ring bytes equal to its slab row's, for launches of up to 4 blocks wrapping the ring."""
    dev = torch.device(dev)
    n_slots, bb = 7, S - 100                      # block bytes below the stride, as a store's padding leaves
    slab = _slab(16).pin_memory() if dev.type == "cuda" else _slab(16)
    ring = slab_copies.StagingRing(n_slots, S, bb, dev, SlabRows(slab))
    if dev.type == "cuda":
        assert ring.rows.memcpy is not None       # the engine's path: the driver on the blocks' addresses
    rows, seen = ROWS[order], []
    for a in range(0, len(rows), 4):
        part = rows[a:a + 4]
        ptrs = ring.stage(part)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        for p, r, slot in zip(ptrs, part, ring.used):
            assert p == ring.buf[slot].data_ptr()
            seen.append(torch.equal(ring.buf[slot, :bb].cpu(), slab[r, :bb]))
        ring.read_by_current_stream()
    return seen


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the staging ring's copy stream and events: CUDA")


@CUDA
@pytest.mark.parametrize("streams", ["1", "2"])
@pytest.mark.parametrize("order", list(ROWS))
def test_ring_holds_the_sources(order, streams, monkeypatch):
    """One copy stream, or the runs alternating between two (MOESTREAM_STAGE_STREAMS=2)."""
    monkeypatch.setenv("MOESTREAM_STAGE_STREAMS", streams)
    assert all(_staged_right(order))


@CUDA
def test_ring_twin_merging_across_gaps_is_caught(monkeypatch):
    monkeypatch.setattr(slab_copies, "copy_runs", _slots_only)
    assert not all(_staged_right("gaps"))


def test_on_by_default_and_zero_copies_block_by_block(monkeypatch):
    monkeypatch.delenv("MOESTREAM_COPY_RUNS")
    assert copy_runs([0, 1, 2], [0, 1, 2]) == [(0, 3)]
    monkeypatch.setenv("MOESTREAM_COPY_RUNS", "0")
    assert copy_runs([0, 1, 2], [0, 1, 2]) == [(0, 1), (1, 1), (2, 1)]


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


@pytest.mark.parametrize("streams", ["1", "2"])
@pytest.mark.parametrize("order", list(ROWS))
def test_ring_holds_the_sources_on_the_cpu(order, streams, streams_faked, monkeypatch):
    monkeypatch.setenv("MOESTREAM_STAGE_STREAMS", streams)
    assert all(_staged_right(order, "cpu"))


def test_ring_twin_merging_across_gaps_is_caught_on_the_cpu(streams_faked, monkeypatch):
    monkeypatch.setattr(slab_copies, "copy_runs", _slots_only)
    assert not all(_staged_right("gaps", "cpu"))


def test_ring_waits_once_per_launch_for_the_slots_it_refills(streams_faked):
    """A launch's slots share one `free` event (recorded after its kernels): refilling them waits for it once, not
    once per slot; slots never read wait for nothing. Twin: an event recorded per slot would be waited for per
    slot, and the count shows it."""
    waits = []
    slab = _slab(16)
    ring = slab_copies.StagingRing(8, S, S, torch.device("cpu"), SlabRows(slab))
    ring.stream.wait_event = waits.append        # what the copy stream waits for
    ring.stage([0, 1, 2, 3])
    assert waits == []                           # fresh slots: nothing read them
    ring.read_by_current_stream()
    ring.stage([4, 5, 6, 7])
    ring.read_by_current_stream()
    ring.stage([8, 9, 10, 11])                   # the first launch's four slots, refilled
    assert len(waits) == 1, waits
    per_slot = [_Event() for _ in range(4)]      # the twin: what an event per slot would cost
    ring.free[:4] = per_slot
    waits.clear()
    ring.stage([12, 13, 14, 15, 0, 1, 2, 3])     # wraps into slots 4-7 and then 0-3
    assert len(waits) == 1 + 4, waits


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
        ring = slab_copies.StagingRing(6, S, S, dev, SlabRows(slab, chunk=4))
        assert ring.rows.memcpy is not None
        ring.stage(rows)
        torch.cuda.synchronize()
        assert ring.runs_ok
        assert all(torch.equal(ring.buf[q].cpu(), slab[r]) for q, r in zip(ring.used, rows))
        twin = slab_copies.StagingRing(6, S, S, dev, SlabRows(slab))          # no chunks: one run across them
        with pytest.warns(RuntimeWarning, match="one copy per block"):
            twin.stage(rows)
        torch.cuda.synchronize()
        assert not twin.runs_ok
        assert all(torch.equal(twin.buf[q].cpu(), slab[r]) for q, r in zip(twin.used, rows))
    finally:
        for off in (0, 4 * S):
            cudart.cudaHostUnregister(base + off)


def test_slab_rows_one_copy_a_run_or_block_by_block_with_a_warning(monkeypatch):
    """The copies the staging ring and the copies ahead share (slab_copies.SlabRows): a run of adjacent rows in one
    copy; where one run's copy fails it says so once and copies block by block from then on (bytes still right)."""
    stride = 64
    slab = torch.arange(8 * stride, dtype=torch.int64).to(torch.uint8).view(8, stride)
    rows = SlabRows(slab)
    buf = torch.zeros(5, stride, dtype=torch.uint8)
    calls = []
    real = SlabRows._one

    def counted(self, buf, row, slot, nbytes, stream, driver):
        calls.append(nbytes)
        return real(self, buf, row, slot, nbytes, stream, driver)
    monkeypatch.setattr(SlabRows, "_one", counted)
    assert rows.copy(buf, [1, 2, 3], [2, 3, 4], stride, None, "test") == [(0, 3)]
    assert calls == [3 * stride] and torch.equal(buf[1:4], slab[2:5])
    assert not buf[0].any() and not buf[4].any() and rows.runs_ok
    monkeypatch.setattr(SlabRows, "_one", lambda self, buf, row, slot, nbytes, stream, driver:
                        nbytes <= stride and real(self, buf, row, slot, nbytes, stream, driver))   # runs refused
    buf.zero_()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert rows.copy(buf, [0, 1, 2], [5, 6, 7], stride - 8, None, "test") == [(0, 1), (1, 1), (2, 1)]
    assert not rows.runs_ok and any("adjacent slab rows failed" in str(x.message) for x in w)
    assert torch.equal(buf[:3, :stride - 8], slab[5:8, :stride - 8]) and not buf[:3, stride - 8:].any()


def _read_at_once(skip_join: bool, monkeypatch) -> bool:
    """Four single-block runs over two copy streams, the second held up by a sleeping kernel; the compute stream
    copies the ring out right after `stage`, with no host sync: right only if it waited for both streams."""
    monkeypatch.setenv("MOESTREAM_STAGE_STREAMS", "2")
    slab = _slab(16).pin_memory()
    ring = slab_copies.StagingRing(8, S, S, torch.device("cuda"), SlabRows(slab))
    if skip_join:            # the twin: the first stream does not wait for the second before its `done` event
        monkeypatch.setattr(torch.cuda.Stream, "wait_stream", lambda self, other: None)
    with torch.cuda.stream(ring.streams[1]):
        torch.cuda._sleep(200_000_000)       # ~0.1 s on an H200
    rows = [0, 2, 4, 6]
    ring.stage(rows)
    seen = ring.buf[ring.used].clone()
    torch.cuda.synchronize()
    return all(torch.equal(seen[i].cpu(), slab[r]) for i, r in enumerate(rows))


@CUDA
def test_two_copy_streams_the_compute_stream_waits_for_both(monkeypatch):
    assert _read_at_once(False, monkeypatch)


@CUDA
def test_twin_two_copy_streams_unjoined_is_caught(monkeypatch):
    assert not _read_at_once(True, monkeypatch)


def test_two_copy_streams_by_default(monkeypatch):
    monkeypatch.delenv("MOESTREAM_STAGE_STREAMS", raising=False)
    assert slab_copies.stage_streams() == 2
    monkeypatch.setenv("MOESTREAM_STAGE_STREAMS", "1")
    assert slab_copies.stage_streams() == 1
