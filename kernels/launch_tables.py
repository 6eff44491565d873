"""Small int64 tables for kernel launches (tile tables, block addresses, row indexes) moved host -> device by the SMs,
never by the copy engine.

A launch's table used to go as `torch.tensor(..., pin_memory=True).to(device, non_blocking=True)`: a cudaMemcpyAsync of
a few KB on the compute stream. While the copy streams hold a layer's worth of bulk copies (1-2 GB of expert blocks
copied ahead), such a copy can wait behind all of them: on the H200 (bench/NOTES.md, session 15 calls 1-2) the table
of a layer's third launch, queued at 24 ms, ran at 62 ms, when 2.4 GB of copies queued before it had landed, and
every kernel of the layer after it waited too. The copies ahead were meant to overlap the layer's kernels; instead
kernels and copies ran one after the other (16k tokens: 2 ms of a 218 ms prompt with both at once).

Here the values are written into a pinned host ring and one small kernel on the current stream reads them over the
bus into a device ring at the same offset (loads by the SMs, which no copy queue orders). The consuming kernels then
read device memory as before. A host region is rewritten only after the fetch that read it has run (an event per
fetch, waited for when the ring comes round to it: at 1 Mi words, once in many prompts, by then long done); a device
region is rewritten by a later fetch on the same stream, so in stream order after the kernels that read it (a fetch
on another stream first waits for the last one's stream).
"""
from __future__ import annotations

import collections
import contextlib
import threading

import torch
import triton
import triton.language as tl

from kernels.backend import varying

FETCH_BLOCK = 1024
TABLE_WORDS = 1 << 20               # the rings' size in int64 words (8 MiB pinned + 8 MiB on the device)


@triton.jit(**varying("src", "dst_ptr", "n"))
def _fetch_kernel(src, dst_ptr, n, BLOCK: tl.constexpr):
    """dst[i] = src[i] for i < n; src: the address of pinned host int64 words (read over the bus by the SMs)."""
    p = src.to(tl.pointer_type(tl.int64))
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(dst_ptr + o, tl.load(p + o, mask=m), mask=m)


def fetch_torch(host: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Twin of the fetch: the host words copied into dst."""
    dst.copy_(host.to(dst.device))
    return dst


class LaunchTables:
    """A pinned host ring and a device ring of `words` int64 each; `put(values)` -> a device tensor holding them."""

    def __init__(self, device, words: int = TABLE_WORDS, event=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.host = torch.empty(words, dtype=torch.int64, pin_memory=self.cuda)
        self.np = self.host.numpy()
        self.dev = torch.empty(words, dtype=torch.int64, device=self.device)
        self.base = self.host.data_ptr()
        self.at, self.cycle = 0, 0
        self.inflight: collections.deque = collections.deque()   # (cycle, start, end, event), in the order put
        self._event = event or (_record if self.cuda else (lambda: None))
        self._stream = None
        self.waited = 0                     # fetches waited for before their host region was rewritten (a count)
        self._lock = threading.Lock()       # one cursor: two threads putting at once would share a region

    def put(self, values) -> torch.Tensor:
        """The values (ints) on the device, in a slice of the device ring, valid for kernels queued on the current
        stream after this call (and until TABLE_WORDS more words have been put)."""
        k = len(values)
        if k == 0:
            return self.dev[:0]
        with self._lock:
            return self._put(values, k)

    @contextlib.contextmanager
    def fetched_by(self, values):
        """`put` where the caller's own kernel fetches the words (one launch fewer): yields (the device slice, (the
        host address of the words, their count)); inside the block the caller launches, on the current stream, a
        kernel that copies those words into the slice before any kernel reads it (e.g. kernels.expert_prefill_rega's
        `permute_x`). The ring's bookkeeping (the fetch's event, the cursor) follows the block, under the same lock."""
        k = len(values)
        with self._lock:
            a, b = self._write(values, k)
            try:
                yield self.dev[a:b], (self.base + 8 * a, k)
            finally:         # (raised or not: a kernel may have been queued that reads the words)
                self._fetched(a, b)

    def _put(self, values, k: int) -> torch.Tensor:
        a, b = self._write(values, k)
        _fetch_kernel[(triton.cdiv(k, FETCH_BLOCK),)](self.base + 8 * a, self.dev[a:b], k, BLOCK=FETCH_BLOCK)
        self._fetched(a, b)
        return self.dev[a:b]

    def _write(self, values, k: int) -> tuple[int, int]:
        """The values into the host ring's next k words (a region no queued fetch still reads); their [a, b)."""
        if k > len(self.np):
            raise ValueError(f"a launch table of {k} words: the ring holds {len(self.np)}")
        if self.at + k > len(self.np):     # round the ring: the last round's fetches still listed (past the cursor)
            self._drain(lambda c, s: c < self.cycle)
            self.at, self.cycle = 0, self.cycle + 1
        a, b = self.at, self.at + k
        self._drain(lambda c, s: c < self.cycle and s < b)       # the last round's fetches in [a, b)
        self.np[a:b] = values
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            if self._stream is not None and self._stream != cur:
                cur.wait_stream(self._stream)           # the device ring's earlier readers, on the other stream
            self._stream = cur
        return a, b

    def _fetched(self, a: int, b: int) -> None:
        """The fetch of [a, b) is queued: its event listed (the host words are rewritten after it), the cursor on."""
        self.inflight.append((self.cycle, a, b, self._event()))
        self.at = b

    def _drain(self, overlaps) -> None:
        q = self.inflight
        while q and overlaps(q[0][0], q[0][1]):
            ev = q.popleft()[3]
            if ev is not None:
                ev.synchronize()
                self.waited += 1


def _record():
    ev = torch.cuda.Event()
    ev.record()
    return ev


_TABLES: dict = {}


def device_table(values, device) -> torch.Tensor:
    """An int64 launch table on `device`: through the device's LaunchTables on CUDA (no copy engine), a plain tensor
    on the CPU. A table larger than the ring (never seen: a launch's row index is bounded by its rows) goes as a
    pinned copy, as before the ring."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    if len(values) > TABLE_WORDS:
        return torch.as_tensor(values, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    return _tables(device).put(values)


def _tables(device: torch.device) -> LaunchTables:
    """The device's rings (one per device; a CPU's for `table_fetched_by`, which the interpreter's kernels read)."""
    if device.type != "cuda":
        key = (device.type, 0)
    else:
        key = ("cuda", device.index if device.index is not None else torch.cuda.current_device())
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = LaunchTables(torch.device(*key))
    return t


@contextlib.contextmanager
def table_fetched_by(values, device):
    """`device_table` for a caller whose own first kernel fetches the table (`LaunchTables.fetched_by`): yields (the
    table on the device, (host address, words) for that kernel to copy, or None where the table is already there:
    empty, or larger than the ring). On the CPU too (a ring of its own): the interpreter's kernel copies it as the
    GPU's would."""
    device = torch.device(device)
    if len(values) > TABLE_WORDS or not values:
        yield device_table(values, device), None
        return
    with _tables(device).fetched_by(values) as got:
        yield got
