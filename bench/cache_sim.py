"""Benchmark of the shared-memory expert cache against raw reads of the same file.

    python -m bench.cache_sim [--store-dir STORE | --work-dir DIR] [--workers 4] [--reads 256]

Measures, in one run: (1) random whole-block reads through the whole pipeline (client -> prefetcher
-> IO workers -> slab) vs a plain thread pool of O_DIRECT preadv on the same file (goal >= 90 %);
(2) demand-miss latency with an idle disk vs one raw read (goal <= 1.2x); (3) the compute side's
cost of lookup + one message + release per MoE layer, all hits, top-22 (goal <= 25 us).
Without --store-dir it writes a synthetic blocks file of Super-sized blocks (3,096,576 bytes).
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from gpu_worker.cache_supervisor import Supervisor

SUPER_BLOCK = 3_096_576


def synthetic_store(work_dir: Path, n_layers: int, n_experts: int, block_bytes: int):
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "experts.bin"
    stride = (block_bytes + 4095) // 4096 * 4096
    base = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8)
    offsets = (np.arange(n_layers * n_experts, dtype=np.int64) * stride).reshape(n_layers, n_experts)
    checksums = np.zeros((n_layers, n_experts), dtype=np.uint32)
    want = n_layers * n_experts * stride
    fresh = not (path.exists() and path.stat().st_size == want)
    with open(path, "r+b" if not fresh else "wb") as f:
        for i in range(n_layers * n_experts):
            blk = base.copy()
            blk[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            checksums.flat[i] = zlib.crc32(blk)
            if fresh:
                f.write(blk.tobytes() + b"\0" * (stride - block_bytes))
        f.flush()
        os.fsync(f.fileno())      # no writeback competing with the timed reads
    return SimpleNamespace(experts_path=str(path), block_bytes=block_bytes, block_stride=stride,
                           moe_layers=list(range(n_layers)), n_experts=n_experts, offsets=offsets,
                           checksums=checksums)


def raw_pool(store, keys, n_threads: int) -> float:
    """Seconds for a thread pool of O_DIRECT preadv to read `keys` (each thread its own buffer)."""
    fd = os.open(store.experts_path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, store.block_stride) for _ in range(n_threads)]

    def work(t):
        for layer, e in keys[t::n_threads]:
            os.preadv(fd, [bufs[t]], int(store.offsets[layer, e]))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n_threads) as ex:
        list(ex.map(work, range(n_threads)))
    dt = time.perf_counter() - t0
    os.close(fd)
    return dt


def raw_latency(store, keys) -> list[float]:
    fd = os.open(store.experts_path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, store.block_stride)
    out = []
    for layer, e in keys:
        t0 = time.perf_counter()
        os.preadv(fd, [buf], int(store.offsets[layer, e]))
        out.append(time.perf_counter() - t0)
    os.close(fd)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store-dir")
    ap.add_argument("--work-dir", default="/tmp/moestream_bench_cache")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=160)
    ap.add_argument("--block-bytes", type=int, default=SUPER_BLOCK)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reads", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=22)
    ap.add_argument("--read-chunks", type=int, default=4)
    args = ap.parse_args(argv)
    if args.store_dir:
        from expert_store.reader import ExpertStore
        store = ExpertStore.open(args.store_dir)
    else:
        store = synthetic_store(Path(args.work_dir), args.layers, args.experts, args.block_bytes)
    L, E = store.offsets.shape
    rng = np.random.default_rng(1)
    all_keys = [(int(k // E), int(k % E)) for k in rng.permutation(L * E)]
    n = min(args.reads, len(all_keys))
    keys = all_keys[:n]
    gb = n * store.block_bytes / 1e9
    rows = []

    raw_pool(store, keys[:32], args.workers)          # warm up the disk path
    dt_raw = raw_pool(store, keys, args.workers)

    for verify, chunks in ((True, args.read_chunks), (True, 1), (False, 1)):
        with Supervisor(store, n_slots=args.slots, n_workers=args.workers, verify_checksums=verify,
                        worker_args=("--read-chunks", str(chunks))) as sup:
            c = sup.client()
            t0 = time.perf_counter()
            for i in range(0, n, args.top_k):        # one "layer" of misses at a time
                chunk = keys[i:i + args.top_k]
                by_layer = {}
                for layer, e in chunk:
                    by_layer.setdefault(layer, []).append(e)
                for layer, es in by_layer.items():
                    c.request(layer, es)
                held = []
                for layer, es in by_layer.items():
                    held += [s for _, s in c.wait_any(layer, es, timeout=60)]
                c.release(held)
            dt = time.perf_counter() - t0
            s = c.stats()
            assert s["io_failures"] == 0 and s["io_reads"] >= n, s
            direct = all(w["direct"] for w in s["workers"])
        rows.append((f"pipeline, crc32 {'on' if verify else 'off'}, {chunks} preadv/block"
                     f"{'' if direct else ' (buffered)'}",
                     args.workers, n / dt, gb / dt, dt))
    dt_raw = min(dt_raw, raw_pool(store, keys, args.workers))    # best of before and after
    rows = [("raw O_DIRECT preadv, thread pool", args.workers, n / dt_raw, gb / dt_raw, dt_raw)] + rows
    rows = [(a, b, c, d, f"{dt_raw / dt * 100:.0f} %") for a, b, c, d, dt in rows]

    lat_keys = all_keys[n:n + 40] if len(all_keys) >= n + 40 else all_keys[:40]
    lat = {}
    for verify, chunks in ((True, args.read_chunks), (True, 1), (False, 1)):
        with Supervisor(store, n_slots=args.slots, n_workers=args.workers, verify_checksums=verify,
                        worker_args=("--read-chunks", str(chunks))) as sup:
            c = sup.client()
            raw, pipe = [], []
            for layer, e in lat_keys:     # interleaved with raw reads of other blocks: same disk state
                raw += raw_latency(store, [all_keys[(layer * E + e + 7) % len(all_keys)]])
                time.sleep(0.002)
                t0 = time.perf_counter()
                c.request(layer, [e])
                s = c.wait(layer, e)
                pipe.append(time.perf_counter() - t0)
                c.release(s)
                time.sleep(0.002)
            lat[verify, chunks] = (statistics.median(pipe) * 1e3, statistics.median(raw) * 1e3)
    with Supervisor(store, n_slots=args.slots, n_workers=args.workers) as sup:
        c = sup.client()
        # compute-side cost per MoE layer, all hits: lookup + one message + release
        k = min(args.top_k, E, args.slots - 8)
        actual = list(range(k))
        c.request(0, actual)
        c.release([s for _, s in c.wait_any(0, actual)])
        guess = actual[:4]
        ring = c.shm.msg_ring

        def drain():
            while len(ring):
                pass
        # bursts of 100 layers, then let the prefetcher drain its ring (untimed): at real speed a
        # message comes every ~1 ms of GPU work and the ring never fills
        us = []
        for _ in range(20):
            drain()
            t0 = time.perf_counter()
            for _ in range(100):
                hits = c.lookup(0, actual)
                c.request(0, actual, guess, guess_layer=0)
                c.release(list(hits.values()))
            us.append((time.perf_counter() - t0) / 100 * 1e6)
        us_layer = statistics.median(us)
        t0 = time.perf_counter()
        for _ in range(2000):
            c.release(list(c.lookup(0, actual).values()))
        us_lookup = (time.perf_counter() - t0) / 2000 * 1e6
        # message latency: client push -> prefetcher has popped and handled it (ring empty again)
        rtt = []
        for _ in range(200):
            drain()
            t0 = time.perf_counter()
            c.request(0, actual, guess, guess_layer=0)
            drain()
            rtt.append((time.perf_counter() - t0) * 1e6)
            time.sleep(0.001)
        rtt_us = statistics.median(rtt)
        assert len(hits) == k

    print(f"store: {store.experts_path}, {L} x {E} blocks of {store.block_bytes:,} bytes, "
          f"{n} random reads, cache {args.slots} slots")
    print(f"| path | workers | reads/s | GB/s | vs raw |\n|---|---|---|---|---|")
    for name, w, rps, gbs, rel in rows:
        print(f"| {name} | {w} | {rps:.0f} | {gbs:.2f} | {rel} |")
    for (verify, chunks), (pipe_ms, raw_ms) in lat.items():
        print(f"demand-miss latency, idle, crc32 {'on' if verify else 'off'}, {chunks} preadv/block: pipeline {pipe_ms:.2f} ms vs "
              f"one raw O_DIRECT read {raw_ms:.2f} ms = {pipe_ms / raw_ms:.2f}x (goal <= 1.2x)")
    print(f"compute side per MoE layer, top-{k} all hits: lookup+message+release {us_layer:.1f} us "
          f"(goal <= 25 us); lookup+release alone {us_lookup:.1f} us")
    print(f"message latency, client push -> prefetcher pop: median {rtt_us:.0f} us (idle prefetcher)")


if __name__ == "__main__":
    main()
