"""The shared objects of one run: slab, control segment (index, counters, rings) and semaphores.

One `CacheShm.create(...)` owns the run: it checks /dev/shm, creates every object (mode 0600, names
under one per-run prefix), and `close()` unlinks them all. Other processes `CacheShm.attach(prefix)`.

Control segment = a msgpack config blob, then numpy arrays at 64-byte-aligned offsets, then rings.
Who writes what (single writer per field at any time):
  slot_of_expert, slot_key, slot_gen, and slot_state EMPTY/LOADING/evict  -> prefetcher
  ready_of_expert[k] = -1 (evict)                                          -> prefetcher
  slot_state LOADING -> READY/FAILED, fail_text, ready_of_expert[k] = slot,
    for a slot it is loading (the prefetcher leaves a loading slot alone)  -> that IO worker
  slot_pins                                                                -> the compute client
  pf_counters / worker_counters[w] / client_counters                       -> prefetcher / worker w / client
"""
from __future__ import annotations

import errno
import mmap
import os
import struct
import time

import msgpack
import numpy as np
import posix_ipc

from .names import list_entries, new_prefix, unlink_entry
from .ring import Ring

FORMAT_VERSION = 1
PAGE = 4096
CFG_BYTES = 8192

# slot states
EMPTY, LOADING, READY, FAILED = 0, 1, 2, 3
STATE_NAMES = {EMPTY: "empty", LOADING: "loading", READY: "ready", FAILED: "failed"}
# request kinds
DEMAND, PREFETCH = 0, 1

# hold_ahead 1: while decoding, no read ahead starts while a demand read is out (CacheClient.hold_ahead)
HDR_FIELDS = ["epoch", "prefetcher_pid", "stopping", "created_ns", "hold_ahead"]
PF_COUNTERS = ["hits", "misses", "misses_inflight", "demand_reads", "prefetch_issued",
               "prefetch_used", "prefetch_wasted", "prefetch_cancelled", "evictions", "messages",
               "demand_queue", "prefetch_queue", "stalls_no_slot", "failed_slots",
               "prefill_forced",     # a prefill's reads that took a block it had not passed (nothing spent was free)
               "prefetch_refused",   # reads ahead the policy's admission turned down (prefetcher/policy.py ReusePolicy)
               "warm_reads",         # blocks read into free slots by a warm message (CacheClient.warm)
               "prefetch_held"]      # dispatch passes that held back reads ahead behind demand reads (hold_ahead)
WORKER_COUNTERS = ["pid", "direct", "reads", "bytes_read", "failures", "read_ns",
                   "demand_reads", "prefetch_reads", "ready"]
CLIENT_COUNTERS = ["lookups", "lookup_hits", "lookup_misses", "requests", "waits", "wait_ns",
                   "resends"]
INFLIGHT_FIELDS = ["valid", "gen", "slot", "layer", "expert", "kind", "started_ns"]

REQ = struct.Struct("<qiiiiq")     # gen, slot, layer, expert, kind, dispatched (monotonic ns: cache_shm/io_trace.py)
DONE = struct.Struct("<qiii")      # gen, slot, ok, kind


class CacheSizeError(RuntimeError):
    """The slab does not fit in /dev/shm."""


def _idx(names):
    return {n: i for i, n in enumerate(names)}


HDR, PFC, WKC, CLC, INF = (_idx(HDR_FIELDS), _idx(PF_COUNTERS), _idx(WORKER_COUNTERS),
                           _idx(CLIENT_COUNTERS), _idx(INFLIGHT_FIELDS))


def human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_shm_bytes() -> tuple[int, int]:
    """(free, total) bytes of the /dev/shm filesystem."""
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _layout(cfg: dict):
    """Byte offsets of every array and ring in the control segment, from the config alone."""
    L, E, S, W = cfg["n_layers"], cfg["n_experts"], cfg["n_slots"], cfg["n_workers"]
    arrays = [("hdr", np.int64, (len(HDR_FIELDS),)),
              ("store_offsets", np.int64, (L, E)),
              ("store_checksums", np.uint32, (L, E)),
              ("slot_of_expert", np.int32, (L, E)),
              ("ready_of_expert", np.int32, (L, E)),
              ("slot_key", np.int32, (S,)),
              ("slot_state", np.int32, (S,)),
              ("slot_gen", np.int64, (S,)),
              ("slot_pins", np.int32, (S,)),
              ("fail_text", np.uint8, (S, cfg["fail_text_bytes"])),
              ("pf_counters", np.int64, (len(PF_COUNTERS),)),
              ("worker_counters", np.int64, (W, len(WORKER_COUNTERS))),
              ("client_counters", np.int64, (len(CLIENT_COUNTERS),)),
              ("inflight", np.int64, (W, len(INFLIGHT_FIELDS)))]
    rings = [("msg", cfg["msg_cap"], cfg["msg_record_bytes"])]
    for w in range(W):
        rings += [(f"demand{w}", cfg["demand_cap"], 64), (f"prefetch{w}", cfg["prefetch_cap"], 64),
                  (f"done{w}", cfg["demand_cap"] + cfg["prefetch_cap"] + 8, 64)]
    off = CFG_BYTES
    placed_arrays, placed_rings = [], []
    for name, dt, shape in arrays:
        off = (off + 63) // 64 * 64
        placed_arrays.append((name, dt, shape, off))
        off += int(np.prod(shape)) * np.dtype(dt).itemsize
    for name, cap, rec in rings:
        off = (off + 127) // 128 * 128
        placed_rings.append((name, cap, rec, off))
        off += Ring.nbytes(cap, rec)
    return placed_arrays, placed_rings, (off + PAGE - 1) // PAGE * PAGE


class CacheShm:
    """Mapped view of a run's shared objects. `owner=True` for the creator, which unlinks on close."""

    def __init__(self, prefix: str, owner: bool):
        self.prefix = prefix
        self.owner = owner
        self._closed = False
        self._created: list[str] = []   # /dev/shm entry names, for cleanup by the owner

    # ---- creation and attachment -----------------------------------------------------------
    @classmethod
    def create(cls, store, *, cache_bytes: int | None = None, n_slots: int | None = None,
               n_workers: int = 4, verify_checksums: bool = True, direct: str = "auto",
               prefetch_depth: int = 2, prefix: str | None = None, demand_cap: int = 256,
               prefetch_cap: int = 16, msg_cap: int = 256, msg_record_bytes: int = 4096):
        """Create a run's objects for `store` (duck type: experts_path, block_bytes, block_stride,
        n_experts, offsets [L, E] int64, checksums [L, E] uint32)."""
        stride = int(store.block_stride)
        if stride % PAGE or stride < store.block_bytes:
            raise ValueError(f"block_stride {stride} must be a multiple of {PAGE} and >= block_bytes")
        if n_slots is None:
            if cache_bytes is None:
                raise ValueError("give cache_bytes or n_slots")
            n_slots = int(cache_bytes) // stride
        if n_slots < 1:
            raise CacheSizeError(f"a cache of {cache_bytes} bytes holds no slot of {stride} bytes")
        offsets = np.asarray(store.offsets, dtype=np.int64)
        checksums = np.asarray(store.checksums, dtype=np.uint32)
        L, E = offsets.shape
        if (offsets % PAGE).any():
            raise ValueError("store block offsets must be 4096-aligned for O_DIRECT")
        cfg = dict(version=FORMAT_VERSION, prefix=prefix or new_prefix(), owner_pid=os.getpid(),
                   n_layers=L, n_experts=E, n_slots=int(n_slots), slot_bytes=stride,
                   block_bytes=int(store.block_bytes), n_workers=int(n_workers),
                   experts_path=os.path.abspath(str(store.experts_path)),
                   verify_checksums=bool(verify_checksums), direct=direct,
                   prefetch_depth=int(prefetch_depth), demand_cap=demand_cap,
                   prefetch_cap=prefetch_cap, msg_cap=msg_cap, msg_record_bytes=msg_record_bytes,
                   fail_text_bytes=200)
        _, _, ctl_bytes = _layout(cfg)
        slab_bytes = cfg["n_slots"] * stride
        free, total = free_shm_bytes()
        if slab_bytes + ctl_bytes > free:
            raise CacheSizeError(
                f"cache of {human_bytes(slab_bytes)} ({n_slots} slots x {stride} bytes) + "
                f"{human_bytes(ctl_bytes)} of index does not fit in /dev/shm: "
                f"{human_bytes(free)} free of {human_bytes(total)}; lower --cache-gb or "
                f"enlarge /dev/shm (mount -o remount,size=...)")
        self = cls(cfg["prefix"], owner=True)
        try:
            self._slab_shm = self._new_shm("slab", slab_bytes, what="slab")
            self._ctl_shm = self._new_shm("ctl", ctl_bytes, what="index")
            self._map(cfg)
            blob = msgpack.packb(cfg)
            assert len(blob) + 4 <= CFG_BYTES
            self._ctl_mm[0:4] = len(blob).to_bytes(4, "little")
            self._ctl_mm[4:4 + len(blob)] = blob
            self.store_offsets[:] = offsets
            self.store_checksums[:] = checksums
            self.slot_of_expert[:] = -1
            self.ready_of_expert[:] = -1
            self.slot_key[:] = -1
            self.hdr[HDR["created_ns"]] = time.time_ns()
            self._open_sems(create=True)
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def attach(cls, prefix: str):
        self = cls(prefix, owner=False)
        self._ctl_shm = posix_ipc.SharedMemory(prefix + "ctl")
        head = os.pread(self._ctl_shm.fd, CFG_BYTES, 0)
        n = int.from_bytes(head[:4], "little")
        cfg = msgpack.unpackb(head[4:4 + n])
        self._slab_shm = posix_ipc.SharedMemory(prefix + "slab")
        self._map(cfg)
        self._open_sems(create=False)
        return self

    def _new_shm(self, suffix: str, nbytes: int, what: str):
        shm = posix_ipc.SharedMemory(self.prefix + suffix, posix_ipc.O_CREX, mode=0o600, size=0)
        self._created.append(self.prefix.lstrip("/") + suffix)
        try:
            # Reserve every page now: on a full tmpfs a plain ftruncate'd segment SIGBUSes at first touch.
            os.posix_fallocate(shm.fd, 0, nbytes)
        except OSError as e:
            shm.close_fd()
            free, total = free_shm_bytes()
            reason = "/dev/shm is full" if e.errno == errno.ENOSPC else os.strerror(e.errno or 0)
            raise CacheSizeError(
                f"cannot reserve the {what} of {human_bytes(nbytes)} in /dev/shm ({reason}; "
                f"{human_bytes(free)} free of {human_bytes(total)}); lower --cache-gb") from e
        return shm

    def _map(self, cfg: dict):
        self.cfg = cfg
        for k in ("n_layers", "n_experts", "n_slots", "slot_bytes", "block_bytes", "n_workers"):
            setattr(self, k, int(cfg[k]))
        self.experts_path = cfg["experts_path"]
        arrays, rings, ctl_bytes = _layout(cfg)
        self._slab_mm = mmap.mmap(self._slab_shm.fd, self.n_slots * self.slot_bytes)
        self._ctl_mm = mmap.mmap(self._ctl_shm.fd, ctl_bytes)
        self._slab_shm.close_fd()
        self._ctl_shm.close_fd()
        self.slab = np.frombuffer(self._slab_mm, dtype=np.uint8).reshape(self.n_slots, self.slot_bytes)
        for name, dt, shape, off in arrays:
            n = int(np.prod(shape))
            setattr(self, name, np.frombuffer(self._ctl_mm, dtype=dt, count=n, offset=off).reshape(shape))
        mv = memoryview(self._ctl_mm)
        self._mv = mv
        self.rings = {name: Ring(mv[off:off + Ring.nbytes(cap, rec)], cap, rec)
                      for name, cap, rec, off in rings}
        self.msg_ring = self.rings["msg"]
        self.demand_rings = [self.rings[f"demand{w}"] for w in range(self.n_workers)]
        self.prefetch_rings = [self.rings[f"prefetch{w}"] for w in range(self.n_workers)]
        self.done_rings = [self.rings[f"done{w}"] for w in range(self.n_workers)]

    def _open_sems(self, create: bool):
        def sem(suffix):
            if create:
                s = posix_ipc.Semaphore(self.prefix + suffix, posix_ipc.O_CREX, mode=0o600, initial_value=0)
                self._created.append("sem." + self.prefix.lstrip("/") + suffix)
                return s
            return posix_ipc.Semaphore(self.prefix + suffix)
        self.sem_prefetcher = sem("pf")      # messages and completions for the prefetcher
        self.sem_ready = sem("ready")        # a slot became ready or failed (for the compute side)
        self.sem_workers = [sem(f"w{w}") for w in range(self.n_workers)]

    # ---- helpers ---------------------------------------------------------------------------
    def populate_slab(self, chunk_bytes: int = 1 << 30) -> bool:
        """Map every slab page into this process now (MADV_POPULATE_WRITE, Linux >= 5.14; the
        contents are untouched). Without it the first read into each slot in each process takes
        ~1 ms of page faults per 3 MB block (measured); the cost is the page tables, 8 bytes per
        4 KiB page per process (20 GB slab: 40 MB). Returns False where the kernel lacks it."""
        mm, total = self._slab_mm, self.n_slots * self.slot_bytes
        try:
            for off in range(0, total, chunk_bytes):
                mm.madvise(23, off, min(chunk_bytes, total - off))   # MADV_POPULATE_WRITE
        except OSError:
            return False
        return True

    def fail_reason(self, slot: int) -> str:
        return bytes(self.fail_text[slot]).split(b"\0", 1)[0].decode("utf-8", "replace")

    def set_fail_reason(self, slot: int, text: str) -> None:
        b = text.encode("utf-8", "replace")[:self.fail_text.shape[1] - 1]
        self.fail_text[slot, :] = 0
        self.fail_text[slot, :len(b)] = np.frombuffer(b, dtype=np.uint8)

    def stats(self) -> dict:
        """Every shared counter, by name (worker counters summed, plus a per-worker list)."""
        out = {n: int(self.pf_counters[i]) for n, i in PFC.items()}
        out.update({n: int(self.client_counters[i]) for n, i in CLC.items()})
        for n, i in WKC.items():
            if n not in ("pid", "direct", "ready"):
                out["io_" + n] = int(self.worker_counters[:, i].sum())
        out["workers"] = [{n: int(self.worker_counters[w, i]) for n, i in WKC.items()}
                          for w in range(self.n_workers)]
        out["epoch"] = int(self.hdr[HDR["epoch"]])
        return out

    def entries(self) -> list[str]:
        return list_entries(self.prefix)

    # ---- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap; the owner also unlinks every object of the run (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for r in getattr(self, "rings", {}).values():
            r.release()
        for name in ("slab", "hdr", "store_offsets", "store_checksums", "slot_of_expert", "ready_of_expert", "slot_key",
                     "slot_state", "slot_gen", "slot_pins", "fail_text", "pf_counters",
                     "worker_counters", "client_counters", "inflight", "rings", "msg_ring",
                     "demand_rings", "prefetch_rings", "done_rings"):
            self.__dict__.pop(name, None)
        if getattr(self, "_mv", None) is not None:
            self._mv.release()
        for mm in ("_slab_mm", "_ctl_mm"):
            m = getattr(self, mm, None)
            if m is not None:
                try:
                    m.close()
                except BufferError:
                    pass  # a caller still holds a view; the mapping goes when the process exits
        for s in [getattr(self, "sem_prefetcher", None), getattr(self, "sem_ready", None),
                  *getattr(self, "sem_workers", [])]:
            if s is not None:
                try:
                    s.close()
                except posix_ipc.Error:
                    pass
        if self.owner:
            for entry in self._created:
                unlink_entry(entry)
            for entry in list_entries(self.prefix):   # anything a crash in create left half-made
                unlink_entry(entry)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
