"""How one block read's pieces overlap on this disk: one preadv, pieces on threads sharing a descriptor, pieces on
threads with a descriptor each, pieces on processes (each its own descriptor).

Session 30's IO trace (bench.io_trace) found a lone 3.1 MB read taking 8-10 ms on the GPU hosts' virtual disk
whether the IO worker read it in 4, 8 or 16 concurrent pieces (threads of one process, one file descriptor), while
eight workers' reads together moved ~1.5-2 GB/s. If pieces on separate descriptors or processes overlap where pieces
on one descriptor do not, a demand read (on the token's path, one a layer) can be made several times faster by how it
is split; if none overlaps, a read's latency is the disk's and only fewer demand reads help.

Each mode reads `--blocks` distinct blocks of `--block-mb` one after another (O_DIRECT, a file of its own written
first, never read before) and reports each block's median and p90 latency and the GB/s of one block.

    python -m bench.disk_pieces --dir /tmp/w --out disk_pieces.json [--blocks 24] [--block-mb 3] [--pieces 4,16]
"""
from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import threading
import time

import numpy as np

from io_workers.reader import ALIGN, block_pieces, open_blocks, pread_full     # the IO workers' own open, split, read


def _buf(n: int) -> mmap.mmap:
    return mmap.mmap(-1, (n + ALIGN - 1) // ALIGN * ALIGN)


def _open(path: str) -> int:
    return open_blocks(path)[0]          # O_DIRECT where the filesystem allows it, as the IO workers do


def _read(fd: int, buf, off: int, a: int, b: int) -> None:
    if pread_full(fd, memoryview(buf)[a:b], off + a, "disk_pieces.bin") < b - a:
        raise OSError(f"short read at {off + a}")


def _proc_worker(path: str, conn, block: int) -> None:
    fd, buf = _open(path), _buf(block)
    conn.send(0)                    # ready: started, imported, the file open
    while True:
        job = conn.recv()
        if job is None:
            return
        off, a, b = job
        _read(fd, buf, off, a, b)
        conn.send(1)


def write_file(path: str, nbytes: int) -> None:
    chunk = 64 << 20
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(chunk, left)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", default="disk_pieces.json")
    ap.add_argument("--blocks", type=int, default=24, help="blocks read one after another per mode")
    ap.add_argument("--block-mb", type=float, default=3.0)
    ap.add_argument("--pieces", default="4,16")
    a = ap.parse_args(argv)
    block = int(a.block_mb * 2**20) // ALIGN * ALIGN
    ks = [int(k) for k in a.pieces.split(",") if k.strip()]
    modes = [("whole", 1)] + [(m, k) for k in ks for m in ("threads", "thread_fds", "procs")]
    path = os.path.join(a.dir, "disk_pieces.bin")
    n_blocks = (a.blocks + 1) * len(modes) + 8     # every read its own block, never read before
    write_file(path, n_blocks * block)
    order = np.random.default_rng(1).permutation(n_blocks)
    fd = _open(path)
    res, used = {}, 0
    for mode, k in modes:
        parts = block_pieces(block, k)
        bufs = [_buf(block)]
        fds = [_open(path) for _ in parts] if mode == "thread_fds" else []
        procs = []
        if mode == "procs":
            ctx = mp.get_context("spawn")
            for _ in parts:
                here, there = ctx.Pipe()
                p = ctx.Process(target=_proc_worker, args=(path, there, block), daemon=True)
                p.start()
                procs.append((p, here))
            for p, c in procs:
                c.recv()
        lat = []
        for i in range(a.blocks + 1):        # the first untimed: threads and descriptors warm
            off = int(order[used]) * block
            used += 1
            t = time.perf_counter()
            if mode == "whole":
                _read(fd, bufs[0], off, 0, block)
            elif mode == "procs":
                for (p, c), (x, y) in zip(procs, parts):
                    c.send((off, x, y))
                for p, c in procs:
                    c.recv()
            else:
                ts = [threading.Thread(target=_read, args=(fds[i] if fds else fd, bufs[0], off, x, y))
                      for i, (x, y) in enumerate(parts)]
                for th in ts:
                    th.start()
                for th in ts:
                    th.join()
            if i:
                lat.append((time.perf_counter() - t) * 1e3)
        for p, c in procs:
            c.send(None)
            p.join(5)
        for f in fds:
            os.close(f)
        name = mode if mode == "whole" else f"{mode}{k}"
        res[name] = dict(median_ms=float(np.median(lat)), p90_ms=float(np.percentile(lat, 90)),
                         gbps=block / (float(np.median(lat)) / 1e3) / 1e9, ms=[round(x, 2) for x in lat])
    os.close(fd)
    os.unlink(path)
    out = dict(block_bytes=block, blocks=a.blocks, direct=True, modes=res)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"one block of {block / 2**20:.2f} MiB at a time, {a.blocks} blocks a mode, each never read before")
    print("mode | median ms | p90 ms | GB/s of one block")
    for name, r in res.items():
        print(f"{name} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['gbps']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
