"""A block that fails its checksum is read once more (issue 16.3): a one-time error (a flaky read, a bit flipped
on the way) heals; a block damaged on disk fails again, and the reason says it was read twice."""
from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache_shm"))
from moestream_fake_store import make_fake_store  # noqa: E402

from cache_shm.shm import DEMAND, FAILED, LOADING, READY, CacheShm  # noqa: E402
from io_workers import reader  # noqa: E402


@pytest.fixture()
def worker(tmp_path):
    store = make_fake_store(tmp_path / "s", n_layers=2, n_experts=4)
    shm = CacheShm.create(store, n_slots=4, n_workers=1)
    w = reader.Worker(shm, 0, os.getpid())
    pool = w.pool
    yield store, shm, w
    pool.shutdown()
    os.close(w.fd)
    shm.close()


def load(shm, w, slot: int, layer: int, expert: int) -> int:
    """What the prefetcher does before handing a read to a worker, then the worker's read; the slot's state."""
    gen = int(shm.slot_gen[slot]) + 1
    shm.slot_gen[slot] = gen
    shm.slot_state[slot] = LOADING
    w._process(gen, slot, layer, expert, DEMAND)
    return int(shm.slot_state[slot])


def flip_first_read(monkeypatch, name):
    """The first read through `reader.<name>` gets one byte flipped after it lands (then reads are clean)."""
    real, calls = getattr(reader, name), []

    def once(fd, dest, *a, **k):
        out = real(fd, dest, *a, **k)
        calls.append(1)
        if len(calls) == 1:
            dest[100] = dest[100] ^ 0xFF
            if isinstance(out, tuple):          # read_block_crc checksums as it reads: recompute it
                out = (out[0], zlib.crc32(dest[:a[1]]))
        return out
    monkeypatch.setattr(reader, name, once)
    return calls


@pytest.mark.parametrize("chunks", [4, 1])
def test_a_one_time_read_error_heals(worker, monkeypatch, chunks):
    store, shm, w = worker
    w.pool = w.pool if chunks > 1 else None
    calls = flip_first_read(monkeypatch, "read_block_crc" if chunks > 1 else "read_block")
    assert load(shm, w, 1, 1, 2) == READY, shm.fail_reason(1)
    assert len(calls) == 2 and bytes(shm.slab[1, :store.block_bytes]) == store.block(1, 2)


def test_a_damaged_block_fails_twice_with_its_reason(worker):
    """The twin: on disk the flip is permanent, so the second read fails too."""
    store, shm, w = worker
    store.corrupt(0, 3)
    assert load(shm, w, 2, 0, 3) == FAILED
    why = shm.fail_reason(2)
    assert "checksum mismatch" in why and "(read twice)" in why, why
    assert load(shm, w, 3, 0, 1) == READY           # the rest of the store still reads
