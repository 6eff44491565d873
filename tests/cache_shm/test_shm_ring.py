"""Ring buffer: order, no loss, wraparound, full/empty, across two processes."""
import mmap
import multiprocessing as mp
import os

import posix_ipc
import pytest

from cache_shm.names import new_prefix
from cache_shm.ring import Ring


def test_ring_single_process_wraparound_and_full():
    buf = mmap.mmap(-1, Ring.nbytes(4, 16))
    r = Ring(memoryview(buf), 4, 16)
    assert r.pop() is None and len(r) == 0
    seq = 0
    for _ in range(10):             # 10 x 3 records through 4 slots: wraps several times
        for _ in range(3):
            assert r.push(b"x" * (seq % 12) + bytes([seq]))
            seq += 1
        for i in range(seq - 3, seq):
            assert r.pop() == b"x" * (i % 12) + bytes([i])
    for i in range(4):
        assert r.push(bytes([i]))
    assert not r.push(b"full")      # full: refused, nothing overwritten
    assert r.pending() == [bytes([i]) for i in range(4)]
    assert [r.pop() for _ in range(5)] == [bytes([i]) for i in range(4)] + [None]
    with pytest.raises(ValueError):
        r.push(b"y" * 13)           # larger than a record's payload


def _producer(name, sem_name, n):
    shm = posix_ipc.SharedMemory(name)
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    ring = Ring(memoryview(mm), 8, 32)
    sem = posix_ipc.Semaphore(sem_name)
    for i in range(n):
        payload = i.to_bytes(8, "little") * (1 + i % 3)
        while not ring.push(payload):
            pass
        sem.release()


def test_ring_concurrent_producer_consumer():
    prefix = new_prefix()
    cap, rec, n = 8, 32, 20000
    shm = posix_ipc.SharedMemory(prefix + "ringtest", posix_ipc.O_CREX, mode=0o600,
                                 size=Ring.nbytes(cap, rec))
    sem = posix_ipc.Semaphore(prefix + "ringsem", posix_ipc.O_CREX, mode=0o600)
    try:
        mm = mmap.mmap(shm.fd, shm.size)
        ring = Ring(memoryview(mm), cap, rec)
        p = mp.get_context("fork").Process(target=_producer, args=(shm.name, sem.name, n))
        p.start()
        got = 0
        while got < n:
            m = ring.pop()
            if m is None:
                try:
                    sem.acquire(5)
                except posix_ipc.BusyError:
                    pytest.fail(f"producer stalled after {got} records")
                continue
            assert m == got.to_bytes(8, "little") * (1 + got % 3), f"record {got} out of order or torn"
            got += 1
        p.join(10)
        assert p.exitcode == 0
        assert ring.pop() is None
    finally:
        shm.unlink()
        sem.unlink()
