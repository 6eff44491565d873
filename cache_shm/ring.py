"""Single-producer single-consumer ring of fixed-size records in shared memory.

Layout: head (u64, written only by the producer) at byte 0, tail (u64, written only by the
consumer) at byte 64 (another cache line), then `capacity` records of `record_bytes` each. A record
is a u32 length and that many payload bytes. The producer writes the payload first and then the head
that publishes it; the consumer copies the payload out and then advances the tail that frees it.
x86 keeps stores in program order (TSO); `full_fence` makes the publish order hold elsewhere too.
Waking the other side is the caller's business (a posix_ipc semaphore post after a push).
"""
from __future__ import annotations

import ctypes
import struct
import threading

HEADER_BYTES = 128
_LEN_BYTES = 4
_LEN = struct.Struct("<I")     # a record's length, little-endian as peek reads it
_fence_lock = threading.Lock()


def full_fence() -> None:
    """A full memory barrier: an uncontended lock is a locked RMW (sem_wait/sem_post in CPython)."""
    _fence_lock.acquire()
    _fence_lock.release()


class Ring:
    def __init__(self, buf: memoryview, capacity: int, record_bytes: int):
        assert record_bytes > _LEN_BYTES and capacity > 0
        assert len(buf) >= self.nbytes(capacity, record_bytes), "ring buffer too small"
        self.capacity = capacity
        self.record_bytes = record_bytes
        self._head = ctypes.c_uint64.from_buffer(buf, 0)
        self._tail = ctypes.c_uint64.from_buffer(buf, 64)
        self._data = buf[HEADER_BYTES:HEADER_BYTES + capacity * record_bytes]

    @staticmethod
    def nbytes(capacity: int, record_bytes: int) -> int:
        return HEADER_BYTES + capacity * record_bytes

    @property
    def max_payload(self) -> int:
        return self.record_bytes - _LEN_BYTES

    def __len__(self) -> int:
        return self._head.value - self._tail.value

    def push(self, payload: bytes) -> bool:
        """Producer side: False if the ring is full (nothing written)."""
        n = len(payload)
        if n > self.record_bytes - _LEN_BYTES:
            raise ValueError(f"payload of {n} bytes exceeds ring record of {self.record_bytes - _LEN_BYTES}")
        head = self._head.value
        if head - self._tail.value >= self.capacity:
            return False
        off = (head % self.capacity) * self.record_bytes
        _LEN.pack_into(self._data, off, n)
        self._data[off + _LEN_BYTES:off + _LEN_BYTES + n] = payload
        full_fence()  # payload before the head that publishes it
        self._head.value = head + 1
        return True

    def push_packed(self, st: struct.Struct, *values) -> bool:
        """`push(st.pack(*values))` without the bytes object: packed straight into the record (the decode's layer
        message, cache_shm/client.py). False if the ring is full (nothing written)."""
        if st.size > self.record_bytes - _LEN_BYTES:
            raise ValueError(f"payload of {st.size} bytes exceeds ring record of {self.record_bytes - _LEN_BYTES}")
        head = self._head.value
        if head - self._tail.value >= self.capacity:
            return False
        off = (head % self.capacity) * self.record_bytes
        st.pack_into(self._data, off + _LEN_BYTES, *values)     # raises struct.error before the length is written
        _LEN.pack_into(self._data, off, st.size)
        full_fence()  # payload before the head that publishes it
        self._head.value = head + 1
        return True

    def peek(self) -> bytes | None:
        """Consumer side: the oldest record, not consumed, or None if empty."""
        tail = self._tail.value
        if tail == self._head.value:
            return None
        off = (tail % self.capacity) * self.record_bytes
        n = int.from_bytes(self._data[off:off + _LEN_BYTES], "little")
        return bytes(self._data[off + _LEN_BYTES:off + _LEN_BYTES + n])

    def advance(self) -> None:
        """Consumer side: free the record peek() returned."""
        full_fence()  # finish reading the payload before the producer may overwrite it
        self._tail.value = self._tail.value + 1

    def pop(self) -> bytes | None:
        rec = self.peek()
        if rec is not None:
            self.advance()
        return rec

    def pending(self) -> list[bytes]:
        """A snapshot of the unconsumed records, oldest first, consuming nothing (for recovery)."""
        tail, head = self._tail.value, self._head.value
        out = []
        for i in range(tail, head):
            off = (i % self.capacity) * self.record_bytes
            n = int.from_bytes(self._data[off:off + _LEN_BYTES], "little")
            out.append(bytes(self._data[off + _LEN_BYTES:off + _LEN_BYTES + n]))
        return out

    def release(self) -> None:
        """Drop the exported buffer references so the mapping can be closed."""
        self._head = self._tail = None
        self._data.release()
