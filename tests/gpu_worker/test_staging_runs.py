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


def _slots_only(sources, slots, stride):
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


def test_switch_off_copies_block_by_block(monkeypatch):
    slab = _slab(4)
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
