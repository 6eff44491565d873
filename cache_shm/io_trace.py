"""The IO workers' read trace: when each block read was dispatched, began and ended, off unless asked for.

`MOESTREAM_IO_TRACE` naming a directory when an IO worker starts turns it on: worker w appends one fixed record per
block it reads to `io-<w>.trace` there (mode 0600; ids and times only). The times are CLOCK_MONOTONIC nanoseconds,
one clock for every process of the machine, so a benchmark can put them beside its own windows (`bench.io_trace`).
The dispatch time is the prefetcher's, carried in the read request (`cache_shm.shm.REQ`).

What it is for: where a disk-bound token's time goes (issue 19). Whether the disk was busy while a token waited, how
many reads were in flight, how long a demand read queued behind reads ahead before it began.
"""
from __future__ import annotations

import os
import struct

ENV = "MOESTREAM_IO_TRACE"
# dispatched_ns, started_ns, ended_ns, layer, expert, kind (cache_shm.shm DEMAND / PREFETCH), ok (1 read, 0 failed,
# -1 reused under the worker: nothing read)
RECORD = struct.Struct("<qqqiiii")
FIELDS = ("dispatched_ns", "started_ns", "ended_ns", "layer", "expert", "kind", "ok")


def trace_path(directory: str, worker: int) -> str:
    return os.path.join(directory, f"io-{int(worker)}.trace")


class TraceWriter:
    """One worker's trace file: one `os.write` of RECORD per read (a few µs against a read of milliseconds)."""

    def __init__(self, directory: str, worker: int):
        self.path = trace_path(directory, worker)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, dispatched_ns: int, started_ns: int, ended_ns: int, layer: int, expert: int, kind: int,
              ok: int) -> None:
        os.write(self.fd, RECORD.pack(dispatched_ns, started_ns, ended_ns, layer, expert, kind, ok))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def writer_from_env(worker: int) -> TraceWriter | None:
    """The worker's writer if `MOESTREAM_IO_TRACE` names a directory, else None; a directory that is not there is an
    error that names it (a trace asked for and silently not written would read as a disk that did nothing)."""
    directory = os.environ.get(ENV, "")
    if not directory:
        return None
    if not os.path.isdir(directory):
        raise ValueError(f"{ENV}={directory!r}: not a directory (the IO workers' read trace goes there)")
    return TraceWriter(directory, worker)


def read_trace(directory: str) -> list[tuple]:
    """Every record of every worker's file in `directory`, as (worker, *RECORD fields), in no particular order. A torn
    last record (a worker killed mid-write) is left out."""
    out = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("io-") and name.endswith(".trace")):
            continue
        w = int(name[3:-6])
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        n = len(data) // RECORD.size
        out.extend((w, *RECORD.unpack_from(data, i * RECORD.size)) for i in range(n))
    return out
