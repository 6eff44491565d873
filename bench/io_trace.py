"""Where a disk-bound token's time goes: the IO workers' read trace (cache_shm/io_trace.py) over a benchmark's windows.

A disk regime's floor assumes the disk busy the whole time at the probe's rate (same readers, same queue depth). The
trace says how far the pipeline was from that: the share of the window with at least one read in flight, the mean
number in flight (the probe keeps every reader busy), the rate while busy, and for each kind of read how long it
queued (dispatched by the prefetcher to begun by a worker: behind the worker's other reads) and how long it took.
Service time against the reads in flight when it began says whether the disk slows as the queue deepens (a bandwidth
limit) or not (latency: more reads in flight would move more bytes).

    summarize(read_trace(dir), windows=[(t0_ns, t1_ns), ...], block_bytes=...) -> dict
    with traced_reads() as d: ...engine...; trace_summary(d, block_bytes, windows)
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from unittest import mock

import numpy as np

from cache_shm.io_trace import ENV, FIELDS, read_trace
from cache_shm.shm import DEMAND, PREFETCH

_COL = {name: i + 1 for i, name in enumerate(FIELDS)}     # read_trace's tuples lead with the worker
MAX_DEPTH = 8                                             # in-flight counts from here on are one bin ("8+")


def _clip(a: int, b: int, t0: int, t1: int) -> int:
    return max(0, min(b, t1) - max(a, t0))


def _stats(ms: list[float]) -> dict:
    if not ms:
        return dict(median=None, p90=None, mean=None)
    v = np.asarray(ms, dtype=np.float64)
    return dict(median=float(np.median(v)), p90=float(np.percentile(v, 90)), mean=float(v.mean()))


def summarize(records: list[tuple], windows: list[tuple[int, int]], block_bytes: int) -> dict:
    """The reads of `records` (`cache_shm.io_trace.read_trace`) seen through `windows` (monotonic ns, apart): the
    time shares count only the parts of reads inside a window; the per-read figures count the reads that ended in
    one (a read begun before the window that ends in it was waited for there). Failed reads and requests reused
    under a worker (ok != 1) move no bytes and are left out."""
    windows = sorted((int(a), int(b)) for a, b in windows if b > a)
    for (_, b0), (a1, _) in zip(windows, windows[1:]):
        if a1 < b0:
            raise ValueError("summarize: the windows overlap")
    total = sum(b - a for a, b in windows)
    reads = [r for r in records if r[_COL["ok"]] == 1]
    st, en, di, kd = (_COL[k] for k in ("started_ns", "ended_ns", "dispatched_ns", "kind"))
    depth_ns = np.zeros(MAX_DEPTH + 1, dtype=np.int64)      # window time at 0, 1, ..., MAX_DEPTH+ reads in flight
    busy_ns, read_ns_in, bytes_in = 0, 0, 0.0
    for t0, t1 in windows:
        ev = []
        for r in reads:
            a, b = r[st], r[en]
            c = _clip(a, b, t0, t1)
            if c <= 0:
                continue
            read_ns_in += c
            bytes_in += block_bytes * c / max(b - a, 1)
            ev += [(max(a, t0), 1), (min(b, t1), -1)]
        ev.sort(key=lambda e: (e[0], e[1]))                # an end before a start at the same instant
        t, n = t0, 0
        for x, d in ev:
            if x > t:
                depth_ns[min(n, MAX_DEPTH)] += x - t
                if n:
                    busy_ns += x - t
                t = x
            n += d
        depth_ns[min(n, MAX_DEPTH)] += t1 - t
        if n:
            busy_ns += t1 - t
    ended = [r for r in reads if any(t0 <= r[en] < t1 for t0, t1 in windows)]
    a_sorted = np.sort(np.asarray([r[st] for r in reads], dtype=np.int64))
    b_sorted = np.sort(np.asarray([r[en] for r in reads], dtype=np.int64))
    out = dict(window_ms=total / 1e6, reads_ended=len(ended),
               busy_fraction=busy_ns / total if total else 0.0,
               mean_in_flight=read_ns_in / total if total else 0.0,
               in_flight_share={(str(k) if k < MAX_DEPTH else f"{MAX_DEPTH}+"): float(v / total) if total else 0.0
                                for k, v in enumerate(depth_ns)},
               gbps_while_busy=bytes_in / busy_ns if busy_ns else 0.0,
               gbps_over_windows=bytes_in / total if total else 0.0)
    for name, kind in (("demand", DEMAND), ("prefetch", PREFETCH)):
        rs = [r for r in ended if r[kd] == kind]
        queued = [(r[st] - r[di]) / 1e6 for r in rs if r[di] > 0]     # 0: a restarted worker's, its dispatch lost
        served = [(r[en] - r[st]) / 1e6 for r in rs]
        by_depth: dict[str, list[float]] = {}
        for r in rs:       # the reads in flight as this one began (itself included)
            n = int(np.searchsorted(a_sorted, r[st], "right") - np.searchsorted(b_sorted, r[st], "right"))
            by_depth.setdefault(str(min(n, MAX_DEPTH)), []).append((r[en] - r[st]) / 1e6)
        out[name] = dict(n=len(rs), queued_ms=_stats(queued), served_ms=_stats(served),
                         served_ms_by_in_flight={k: float(np.median(v)) for k, v in sorted(by_depth.items())})
    return out


def line(s: dict) -> str:
    """One printable line of a summary."""
    def q(d):
        return (f"queued {d['queued_ms']['median']:.2f} / {d['queued_ms']['p90']:.2f} ms, served "
                f"{d['served_ms']['median']:.2f} / {d['served_ms']['p90']:.2f}" if d["n"] else "none")
    shares = ", ".join(f"{k}: {v:.2f}" for k, v in s["in_flight_share"].items() if v >= 0.005)
    return (f"io trace over {s['window_ms']:.0f} ms: disk busy {s['busy_fraction']:.2f} of it, "
            f"{s['mean_in_flight']:.2f} reads in flight (share of time by count {shares}), "
            f"{s['gbps_while_busy']:.2f} GB/s while busy, {s['gbps_over_windows']:.2f} over the window; "
            f"demand {s['demand']['n']} ({q(s['demand'])}, median / p90), prefetch {s['prefetch']['n']} "
            f"({q(s['prefetch'])})")


@contextmanager
def traced_reads():
    """A private directory the IO workers of engines started inside trace their reads into (the variable is read by
    each worker as its engine spawns it); the directory and the variable are gone afterwards."""
    with tempfile.TemporaryDirectory(prefix="moestream-iotrace-") as d, mock.patch.dict(os.environ, {ENV: d}):
        yield d


def trace_summary(trace_dir: str, block_bytes: int, windows) -> dict:
    """`summarize` over the reads traced into trace_dir."""
    return summarize(read_trace(trace_dir), windows, block_bytes)
