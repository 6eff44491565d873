"""IO worker process: reads whole expert blocks into slab slots.

One process per worker index w. It consumes two rings that the prefetcher fills, always the demand
ring before the prefetch ring, reads each block with one `preadv` (O_DIRECT where the filesystem
allows it, probed at start), checks its crc32 (a block that fails is read once more: a transient error
heals), marks the slot ready or failed (with the reason), wakes the compute side, and reports the
completion to the prefetcher. The request being served is
recorded in shared memory first, so a restarted worker w finishes what a killed one left.

    python -m io_workers.reader --prefix /moestream-123-abcd- --worker 0 --parent-pid 123
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import posix_ipc

from cache_shm.io_trace import writer_from_env
from cache_shm.shm import (DONE, FAILED, INF, LOADING, READY, REQ, WKC, CacheShm, DEMAND, HDR)
from kernels.expert_block import BLOCK_ALIGN as ALIGN   # torch-free: the geometry is arithmetic
from procs.spawn import die_with_parent


class ReadError(Exception):
    """A block could not be read or verified; the message is the reason shown to the compute side."""


def open_blocks(path: str, direct: str = "auto") -> tuple[int, bool, str | None]:
    """Open the blocks file. direct: "on" (O_DIRECT or raise), "off", "auto" (probe: open plus one
    aligned read; fall back to buffered reads). Returns (fd, is_direct, warning or None)."""
    if direct != "off":
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                probe = mmap.mmap(-1, ALIGN)      # page-aligned scratch buffer
                os.preadv(fd, [probe], 0)
                probe.close()
                return fd, True, None
            except OSError:
                os.close(fd)
                raise
        except OSError as e:
            if direct == "on":
                raise
            warning = (f"io_workers: O_DIRECT refused for {path} ({e.strerror}); "
                       f"using buffered reads (blocks pass through the page cache)")
    else:
        warning = None
    return os.open(path, os.O_RDONLY), False, warning


def read_block(fd: int, dest: memoryview, offset: int, block_bytes: int, is_direct: bool,
               path: str = "the blocks file") -> int:
    """Read one block at `offset` into `dest` (a whole slot: len(dest) = the block stride).
    Returns bytes read; raises ReadError with the reason."""
    if is_direct:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(dest))
        if addr % ALIGN or offset % ALIGN or len(dest) % ALIGN:
            raise ReadError(f"misaligned O_DIRECT read: buffer {addr:#x}, offset {offset}, "
                            f"length {len(dest)} must be multiples of {ALIGN}")
        want = len(dest)       # whole pages; the block's tail padding comes along
    else:
        want = block_bytes
    got = 0
    try:
        while got < block_bytes:
            n = os.preadv(fd, [dest[got:want]], offset + got)
            if n == 0:
                break
            got += n
    except OSError as e:
        raise ReadError(f"read error at offset {offset} of {path}: {e.strerror}") from None
    if got < block_bytes:
        raise ReadError(f"short read: {got} of {block_bytes} bytes at offset {offset} of {path} "
                        f"(store truncated?)")
    return got


def pread_full(fd: int, buf: memoryview, offset: int, path: str) -> int:
    """Read len(buf) bytes at `offset` (fewer only at the end of the file); bytes read, or ReadError."""
    got = 0
    try:
        while got < len(buf):
            n = os.preadv(fd, [buf[got:]], offset + got)
            if n == 0:
                break
            got += n
    except OSError as e:
        raise ReadError(f"read error at offset {offset + got} of {path}: {e.strerror}") from None
    return got


class Crc32Shift:
    """crc32(A + B) from crc32(A), crc32(B) and len(B): zlib.crc32(B, c) is affine in c, so
    crc32(A + B) = L_len(B)(crc32(A)) ^ crc32(B), with L_n linear over GF(2). Its 32 columns are
    computed once per length (lengths here: the chunk size and the last chunk's)."""

    def __init__(self):
        self._cols: dict[int, list[int]] = {}

    def combine(self, crc_a: int, crc_b: int, len_b: int) -> int:
        cols = self._cols.get(len_b)
        if cols is None:
            zeros = bytes(len_b)
            z0 = zlib.crc32(zeros, 0)
            cols = self._cols[len_b] = [zlib.crc32(zeros, 1 << j) ^ z0 for j in range(32)]
        r, j = 0, 0
        while crc_a:
            if crc_a & 1:
                r ^= cols[j]
            crc_a >>= 1
            j += 1
        return r ^ crc_b


_crc_shift = Crc32Shift()


def _read_chunk(fd: int, buf: memoryview, offset: int, path: str, crc_bytes: int) -> tuple[int, int]:
    n = pread_full(fd, buf, offset, path)
    return n, (zlib.crc32(buf[:crc_bytes]) if crc_bytes > 0 else 0)   # zlib releases the GIL


def block_pieces(want: int, n_chunks: int) -> list[tuple[int, int]]:
    """The [a, b) byte ranges a block of `want` bytes is read in: `n_chunks` or fewer, each a multiple of ALIGN."""
    step = ((want + n_chunks - 1) // n_chunks + ALIGN - 1) // ALIGN * ALIGN
    return [(a, min(a + step, want)) for a in range(0, want, step)]


def warm_crc_shift(stride: int, block_bytes: int, n_chunks: int) -> None:
    """Compute the combine columns for this geometry now, not during the first read (~25 ms)."""
    for want in (stride, block_bytes):
        for a, b in block_pieces(want, n_chunks)[1:]:
            if a < block_bytes:
                _crc_shift.combine(0, 0, min(b, block_bytes) - a)


def read_block_crc(fd: int, dest: memoryview, offset: int, block_bytes: int, is_direct: bool,
                   pool, n_chunks: int, path: str = "the blocks file", with_crc: bool = True
                   ) -> tuple[int, int]:
    """Like read_block, in `n_chunks` concurrent preadv calls on `pool`'s threads, each chunk's
    thread also taking its crc32: the checksum (crc32 of 3 MB: 1-2 ms, as long as the read) runs in
    parallel, chunk by chunk, instead of after the read. Returns (bytes read, crc32 of block_bytes)."""
    want = len(dest) if is_direct else block_bytes
    if is_direct:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(dest))
        if addr % ALIGN or offset % ALIGN or want % ALIGN:
            raise ReadError(f"misaligned O_DIRECT read: buffer {addr:#x}, offset {offset}, "
                            f"length {want} must be multiples of {ALIGN}")
    pieces = block_pieces(want, n_chunks)
    futures = [pool.submit(_read_chunk, fd, dest[a:b], offset + a, path,
                           max(min(b, block_bytes) - a, 0) if with_crc else 0) for a, b in pieces]
    crc, got, error = 0, 0, None
    for (a, b), f in zip(pieces, futures):     # every future is waited for: they write into the slot
        try:
            n, piece_crc = f.result()
        except ReadError as e:
            error = error or e
            continue
        if error is None:
            if a + n < min(b, block_bytes):
                error = ReadError(f"short read: {a + n} of {block_bytes} bytes at offset {offset} of "
                                  f"{path} (store truncated?)")
            elif a < block_bytes and with_crc:
                crc = piece_crc if a == 0 else _crc_shift.combine(crc, piece_crc, min(b, block_bytes) - a)
            got = a + n
    if error is not None:
        raise error
    return got, crc


class Worker:
    def __init__(self, shm: CacheShm, w: int, parent_pid: int, fault_delay_ms: float = 0.0,
                 read_chunks: int = 4):
        self.shm, self.w, self.parent_pid = shm, w, parent_pid
        self.read_chunks = read_chunks
        self.pool = ThreadPoolExecutor(read_chunks) if read_chunks > 1 else None
        self.fault_delay_s = fault_delay_ms / 1000.0
        self.verify = bool(shm.cfg["verify_checksums"])
        self.path = shm.experts_path
        self.wc = shm.worker_counters[w]
        self.inflight = shm.inflight[w]
        self.demand, self.prefetch, self.done = shm.demand_rings[w], shm.prefetch_rings[w], shm.done_rings[w]
        self.slab_mv = memoryview(shm.slab).cast("B")
        self.open_error = None
        try:
            self.fd, self.is_direct, warning = open_blocks(self.path, shm.cfg["direct"])
            if warning and w == 0:
                print(warning, file=sys.stderr, flush=True)
        except OSError as e:
            self.fd, self.is_direct = -1, False
            self.open_error = f"cannot open store file {self.path}: {e.strerror}"
            print(f"io_workers[{w}]: {self.open_error}", file=sys.stderr, flush=True)
        shm.populate_slab()          # page faults out of the read path
        if self.pool is not None and self.verify:
            warm_crc_shift(shm.slot_bytes, shm.block_bytes, read_chunks)
        self.wc[WKC["direct"]] = int(self.is_direct)
        self.wc[WKC["pid"]] = os.getpid()
        self.trace = writer_from_env(w)     # the read trace (cache_shm/io_trace.py), None unless asked for

    def serve(self) -> None:
        shm = self.shm
        if self.inflight[INF["valid"]]:   # a killed predecessor's unfinished request
            f = self.inflight
            self._process(int(f[INF["gen"]]), int(f[INF["slot"]]), int(f[INF["layer"]]),
                          int(f[INF["expert"]]), int(f[INF["kind"]]))
            self.inflight[INF["valid"]] = 0
        self.wc[WKC["ready"]] = 1
        while True:
            ring = self.demand if len(self.demand) else self.prefetch   # demand always first
            rec = ring.peek()
            if rec is None:
                if shm.hdr[HDR["stopping"]] or os.getppid() != self.parent_pid:
                    return
                try:
                    shm.sem_workers[self.w].acquire(0.2)
                except posix_ipc.BusyError:
                    pass
                continue
            gen, slot, layer, expert, kind, dispatched = REQ.unpack(rec)
            f = self.inflight
            f[INF["gen"]], f[INF["slot"]], f[INF["layer"]], f[INF["expert"]] = gen, slot, layer, expert
            f[INF["kind"]], f[INF["started_ns"]] = kind, time.monotonic_ns()
            f[INF["valid"]] = 1            # recorded before the ring frees it: nothing is lost on a kill
            ring.advance()
            self._process(gen, slot, layer, expert, kind, dispatched)
            f[INF["valid"]] = 0

    def _process(self, gen: int, slot: int, layer: int, expert: int, kind: int, dispatched: int = 0) -> None:
        """Read one request's block into its slot, publish it, report it; `dispatched`: when the prefetcher sent it
        (monotonic ns, for the trace; 0 for a killed predecessor's request, whose time is lost)."""
        shm = self.shm
        if int(shm.slot_gen[slot]) != gen or int(shm.slot_state[slot]) != LOADING:
            # Reused or reset under us (only after a prefetcher restart), or already finished by our
            # killed predecessor: report it done, touch nothing.
            ok = 1 if int(shm.slot_state[slot]) == READY else 0
            if ok and int(shm.slot_gen[slot]) == gen:
                shm.ready_of_expert[layer, expert] = slot     # it may have died just before this
            self._complete(gen, slot, ok if int(shm.slot_gen[slot]) == gen else -1, kind)
            if self.trace is not None:
                now = time.monotonic_ns()
                self.trace.write(dispatched, now, now, layer, expert, kind, -1)
            return
        t0 = time.monotonic_ns()
        try:
            if self.open_error:
                raise ReadError(self.open_error)
            try:
                n = self._read_verified(slot, layer, expert)
            except ReadError as first:
                # once more: a transient read error or a bit flipped on the way heals; a damaged block fails again
                print(f"io_workers[{self.w}]: {first}; reading the block again", file=sys.stderr, flush=True)
                try:
                    n = self._read_verified(slot, layer, expert)
                except ReadError as e:
                    raise ReadError(f"{e} (read twice)") from None
            self.wc[WKC["bytes_read"]] += n
            ok = 1
        except ReadError as e:
            shm.set_fail_reason(slot, str(e))
            self.wc[WKC["failures"]] += 1
            ok = 0
        self.wc[WKC["reads"]] += 1
        self.wc[WKC["demand_reads" if kind == DEMAND else "prefetch_reads"]] += 1
        t1 = time.monotonic_ns()
        self.wc[WKC["read_ns"]] += t1 - t0
        if self.trace is not None:
            self.trace.write(dispatched, t0, t1, layer, expert, kind, ok)
        shm.slot_state[slot] = READY if ok else FAILED   # after the bytes / the reason
        if ok:
            shm.ready_of_expert[layer, expert] = slot      # publish to lookups last
        shm.sem_ready.release()
        self._complete(gen, slot, ok, kind)

    def _read_verified(self, slot: int, layer: int, expert: int) -> int:
        """Read the block of (layer, expert) into `slot` and check its crc32; bytes read, or ReadError."""
        shm = self.shm
        offset = int(shm.store_offsets[layer, expert])
        stride = shm.slot_bytes
        dest = self.slab_mv[slot * stride:(slot + 1) * stride]
        if self.pool is not None:
            n, got = read_block_crc(self.fd, dest, offset, shm.block_bytes, self.is_direct,
                                    self.pool, self.read_chunks, self.path, self.verify)
        else:
            n = read_block(self.fd, dest, offset, shm.block_bytes, self.is_direct, self.path)
            got = zlib.crc32(dest[:shm.block_bytes]) if self.verify else 0
        if self.fault_delay_s:
            time.sleep(self.fault_delay_s)
        if self.verify:
            want = int(shm.store_checksums[layer, expert])
            if got != want:
                raise ReadError(f"checksum mismatch: crc32 {got:08x}, manifest {want:08x} "
                                f"(block at offset {offset} of {self.path}); corrupted store?")
        return n

    def _complete(self, gen: int, slot: int, ok: int, kind: int) -> None:
        rec = DONE.pack(gen, slot, ok, kind)
        while not self.done.push(rec):     # sized for every outstanding request; only a stalled
            time.sleep(0.001)               # prefetcher fills it
            if os.getppid() != self.parent_pid:
                return
        self.shm.sem_prefetcher.release()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--fault-delay-ms", type=float, default=0.0, help="tests: sleep after each read")
    ap.add_argument("--read-chunks", type=int, default=4,
                    help="concurrent preadv per block, crc32 overlapped with the read (1: one preadv)")
    args = ap.parse_args(argv)
    if not die_with_parent(args.parent_pid):
        return 0
    shm = CacheShm.attach(args.prefix)
    try:
        Worker(shm, args.worker, args.parent_pid, args.fault_delay_ms, args.read_chunks).serve()
    finally:
        shm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
