"""Blocks copied from the pinned slab into device buffers by the copy engine, for the prefill's grouped launches.

- `SlabRows`: slab slots into rows of a device buffer on a copy stream, adjacent slots as one copy (`copy_runs`),
  through the driver's cuMemcpyAsync where it loads.
- `StagingRing`: the slots a layer's launch reads its blocks from when they were not copied ahead (two launches'
  worth, so that one launch's copies overlap the kernels of the one before).
- `AheadSlots`: the slots the next MoE layer's guessed experts are copied into while this layer runs (the copies
  ahead; gpu_worker/ahead_flow.py orders them as a flow).

The prefill step that uses them is gpu_worker/prefill_experts.py. The decode's copies (staged ups, the chosen ups'
DMA) are gpu_worker/up_staging.py and gpu_worker/up_dma.py.
"""
from __future__ import annotations

import os
import warnings

import torch

from gpu_worker.copy_pins import CopyPins

# The copies ahead issued in runs (adjacent slab rows into adjacent slots as one copy, the rest by the driver's
# cuMemcpyAsync) with one ready event per AHEAD_EVENT_EVERY blocks, instead of a torch copy and an event per block:
# session 8 measured 18-31 ms of host time a prompt issuing them (~25 µs a block), about what the copies ahead lost
# at 128 and 1,000 tokens. On by default since session 9: the H200 measured 4,000 tokens 145 -> 136 ms, 16,000
# 220 -> 198 ms (issuing 30 -> 12 and 33 -> 15 ms), the same first tokens (bench/NOTES.md "Session 9").
# MOESTREAM_AHEAD_RUNS=0 (read per layer: bench.prefill's paths ending in "!") issues a copy and an event per block.
AHEAD_EVENT_EVERY = 8


def ahead_run_max() -> int:
    """The longest run of blocks one copy ahead moves (MOESTREAM_AHEAD_RUN_MAX, read per layer; 0, the default:
    unbounded). Built in session 14 on the guess that a layer lying in adjacent slab slots was copied ahead as one
    run with one ready event, so that its first launch waited for all of it; runs of 8 measured equal on the H200
    (16k 195-200 ms either way, 4k 121-127), so the guess was wrong and the default stays unbounded."""
    return int(os.environ.get("MOESTREAM_AHEAD_RUN_MAX", "0"))


def split_runs(runs: list[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """Runs (first index, length) cut into pieces of at most `most` blocks, in order (most <= 0: as they are)."""
    if most <= 0:
        return list(runs)
    return [(i + k, min(most, n - k)) for i, n in runs for k in range(0, n, most)]


def ahead_runs() -> bool:
    return os.environ.get("MOESTREAM_AHEAD_RUNS", "1") != "0"


def stage_streams() -> int:
    """Copy streams the prefill's staging ring spreads a launch's copies over (MOESTREAM_STAGE_STREAMS, read per
    launch): 2 by default, the runs alternating between them — one process on the H200 (session 11 call 3, two pairs):
    16,000 tokens 224 / 223 -> 198 / 200 ms, 4,000 130 / 128 -> 125 / 126, 1,000 104 / 105 -> 101 / 103, 128 equal,
    first tokens equal. MOESTREAM_STAGE_STREAMS=1 is one copy stream, as before."""
    return 1 if os.environ.get("MOESTREAM_STAGE_STREAMS", "2") == "1" else 2


def ahead_copy_plan(runs: list[tuple[int, int]], every: int) -> list[list[tuple[int, int]]]:
    """The copies ahead in groups, one ready event after each: runs ((first index, length), in order, from
    `copy_runs`) gathered until a group holds at least `every` blocks; a run is never split. A launch waits for the
    event of each group its blocks are in, so a group of `every` blocks makes it wait for at most every - 1 blocks
    that it does not read (the launches take ~30 blocks each and read them in this order)."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    groups, cur, n = [], [], 0
    for run in runs:
        cur.append(run)
        n += run[1]
        if n >= every:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        groups.append(cur)
    return groups


def copy_runs(slab_slots: list[int], ring_slots: list[int], chunk: int | None = None) -> list[tuple[int, int]]:
    """(first index, length) of the runs that one copy of whole rows can move: slab slots s, s+1, ... bound for ring
    slots r, r+1, ... (no wrap), inside one of the slab's CUDA registrations (`chunk` slots each: slot s lies in
    registration s // chunk; runs that ignored them raised cudaErrorInvalidValue on the H200, session 7 run 1 — a copy
    spanning two registrations, most likely); chunk None: no registrations to respect."""
    if os.environ.get("MOESTREAM_COPY_RUNS", "1") == "0":     # =0: one copy per block, as before session 8 (the runs
        return [(i, 1) for i in range(len(slab_slots))]        # are on by default: bench/NOTES.md "Session 8")
    runs: list[tuple[int, int]] = []
    for i, s in enumerate(slab_slots):
        if (runs and s == slab_slots[i - 1] + 1 and ring_slots[i] == ring_slots[i - 1] + 1
                and (chunk is None or s // chunk == (s - 1) // chunk)):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class SlabRows:
    """Whole blocks of the pinned slab copied into rows of a device buffer, by slab slot, on a copy stream: through the
    driver's cuMemcpyAsync on the blocks' addresses (~3 µs of host a copy), adjacent slab slots bound for adjacent rows
    as one copy (`copy_runs`). A torch copy_ of a slab view cost ~10 µs and a select per block: on the H200 (session
    11) the driver halved the host's time issuing the copies ahead (4k 17 -> 8 ms, 16k 15 -> 7) and took 8-11 ms off
    the 16k prompt; short prompts, whose host was not their bound, did not move. Where the driver cannot be loaded
    (or on the CPU), torch copies of the slab's views; MOESTREAM_SLAB_COPIES=torch (read per call: a bench.prefill
    path `staged|MOESTREAM_SLAB_COPIES=torch`) takes that path on CUDA too, for the A/B."""

    def __init__(self, slab: torch.Tensor, chunk: int | None = None):
        from gpu_worker.up_staging import driver_memcpy_async
        self.slab, self.chunk = slab, chunk
        self.slot_bytes, self.base = slab.shape[1], slab.data_ptr()
        self.memcpy = driver_memcpy_async() if slab.is_pinned() else None
        self.runs_ok = True          # False after a run's copy failed: one copy per block from then on

    def copy(self, buf: torch.Tensor, rows: list[int], slab_slots: list[int], nbytes: int, stream, what: str):
        """Slab slots' first `nbytes` into buf's `rows` (buf [n, stride] on the device) on `stream` (a list: the copies
        alternate between its streams; None: at once, on the CPU); each copy's (first index, length) in the order
        queued, for the caller's events."""
        stride = buf.shape[1]
        runs = (copy_runs(slab_slots, rows, self.chunk) if self.runs_ok and self.slot_bytes == stride
                else [(i, 1) for i in range(len(rows))])
        streams = stream if isinstance(stream, (list, tuple)) else [stream]
        driver = (self.memcpy is not None and streams[0] is not None
                  and os.environ.get("MOESTREAM_SLAB_COPIES", "driver") != "torch")
        done = []
        for q, (i, k) in enumerate(runs):
            stream = streams[q % len(streams)]
            if k > 1 and not self._one(buf, rows[i], slab_slots[i], k * stride, stream, driver):
                self.runs_ok = False
                warnings.warn(f"{what}: a copy of {k} adjacent slab rows failed; one copy per block from now on",
                              RuntimeWarning, stacklevel=2)
                for q in range(i, i + k):
                    if not self._one(buf, rows[q], slab_slots[q], nbytes, stream, driver):
                        raise RuntimeError(f"{what}: the copy of slab slot {slab_slots[q]} failed")
                    done.append((q, 1))
                continue
            if k == 1 and not self._one(buf, rows[i], slab_slots[i], nbytes, stream, driver):
                raise RuntimeError(f"{what}: the copy of slab slot {slab_slots[i]} failed")
            done.append((i, k))
        return done

    def _one(self, buf, row: int, slot: int, nbytes: int, stream, driver: bool) -> bool:
        if driver:
            dst = buf.data_ptr() + row * buf.shape[1]
            return self.memcpy(dst, self.base + slot * self.slot_bytes, nbytes, stream.cuda_stream) == 0
        k = -(-nbytes // buf.shape[1])
        try:
            src = self.slab[slot:slot + k].view(-1)[:nbytes]
            if stream is None:
                buf[row:row + k].view(-1)[:nbytes].copy_(src)
            else:
                with torch.cuda.stream(stream):
                    buf[row:row + k].view(-1)[:nbytes].copy_(src, non_blocking=True)
            return True
        except RuntimeError:
            return False


def wait_each_once(stream, events) -> None:
    """`stream` waits for each distinct event of `events` once, in their order (None: nothing to wait for)."""
    waited = set()
    for ev in events:
        if ev is not None and id(ev) not in waited:
            waited.add(id(ev))
            stream.wait_event(ev)


class StagingRing:
    """Device slots that the copy engine fills from the pinned slab on its own stream. The compute stream waits
    for a launch's copies; a slot is refilled only after the kernels that read it last have run (one event per
    launch, shared by its slots), so the copies of one launch overlap the kernels of the one before (the ring holds
    two launches)."""

    def __init__(self, n: int, stride: int, block_bytes: int, device, rows: SlabRows):
        self.buf = torch.empty(n, stride, dtype=torch.uint8, device=device)
        self.free = [None] * n      # the event after the kernels that read each slot last (None: never read)
        self.rows = rows
        self.streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
        self.stream = self.streams[0]
        # the buffer comes from the compute stream's pool: its memory may be a tensor freed a moment ago that queued
        # kernels still read; the copy streams write it only after them
        for cs in self.streams:
            cs.wait_stream(torch.cuda.current_stream(device))
        self.device, self.block_bytes = device, block_bytes
        self.next, self.used = 0, []
        base, st = self.buf.data_ptr(), self.buf.stride(0)
        self._address = [base + r * st for r in range(n)]

    @property
    def runs_ok(self) -> bool:
        return self.rows.runs_ok

    def stage(self, slab_slots: list[int], events=None, cur=None) -> list[int]:
        """The blocks in `slab_slots` into the next ring slots; their device addresses. events: (start, end) CUDA
        events recorded on the copy stream around the copies (a profile), or None. Adjacent slab slots bound for
        adjacent ring slots within one of the slab's CUDA registrations go as one copy of whole rows (unless
        MOESTREAM_COPY_RUNS=0, on by default since session 8). cur: the compute stream (None: the current one)."""
        cs, n = self.stream, len(self.free)
        two = stage_streams() == 2
        self.used = used = [(self.next + i) % n for i in range(len(slab_slots))]
        self.next = (self.next + len(slab_slots)) % n
        wait_each_once(cs, (self.free[r] for r in used))   # a launch's slots share one event
        if events is not None:      # the copies alone are timed, not the wait for ring slots the kernels still read
            events[0].record(cs)
        if two:                      # the runs alternate between two copy streams, the second after the first's waits
            start = torch.cuda.Event()
            start.record(cs)
            self.streams[1].wait_event(start)
        self.rows.copy(self.buf, used, slab_slots, self.block_bytes, self.streams if two else cs, "staging ring")
        if two:
            cs.wait_stream(self.streams[1])
        if events is not None:
            events[1].record(cs)
        done = torch.cuda.Event()
        done.record(cs)
        (cur if cur is not None else torch.cuda.current_stream(self.device)).wait_event(done)
        return [self._address[r] for r in used]

    def read_by_current_stream(self, cur=None) -> None:
        ev = torch.cuda.Event()
        ev.record(cur if cur is not None else torch.cuda.current_stream(self.device))
        for r in self.used:
            self.free[r] = ev


class AheadSlots:
    """Device slots for the next MoE layer's experts, copied from the pinned slab on their own stream while this
    layer's last kernels and the dense layers run. A copy waits for an event that follows this layer's own staging
    copies (so that no block this layer needs waits behind a guessed one) and for the kernels that read its slot
    last (an event per slot); a launch waits for its blocks' copies (an event per slot). The slab slots stay pinned
    until their copies are done. On the CPU (tests) the copies are plain and done at once."""

    def __init__(self, n: int, stride: int, block_bytes: int, device, cuda: bool, rows: SlabRows,
                 lent: tuple[torch.Tensor, list[int]] | None = None):
        """lent: (a buffer [*, stride] on the device, n of its rows) to use instead of a buffer of its own: slots a
        VRAM tier lends (`VramTier.lend`), slot r being the buffer's row lent[1][r]."""
        self.n, self.cuda, self.block_bytes, self.device = n, cuda, block_bytes, device
        if lent is None:
            self.buf, self._row = torch.empty(n, stride, dtype=torch.uint8, device=device), list(range(n))
        else:
            self.buf, self._row = lent[0], list(lent[1][:n])
            if len(self._row) != n or lent[0].shape[1] != stride:
                raise ValueError(f"{n} ahead slots of {stride} bytes on {len(self._row)} lent rows of "
                                 f"{lent[0].shape[1]}")
        self.rows = rows                            # the slab and how its blocks are copied
        self.layer, self.table = -1, {}             # the MoE layer copied for, {expert: slot}
        self.next = 0
        base, st = self.buf.data_ptr(), self.buf.stride(0)
        self._address = [base + r * st for r in self._row]   # (a torch select per call cost ~2 µs a block)
        self.pins = CopyPins()                     # slab slots pinned for the copies
        self.stream = None
        if cuda:
            self.stream = torch.cuda.Stream(device)
            self.buf.record_stream(self.stream)     # freed only after the copies queued on it
            # allocated from the compute stream's pool, maybe in memory that its queued kernels still read (a layer's
            # decoded weights or activations just freed): the first copies, whose slots have no `free` event, would
            # overwrite it under them. A suspect for the wrong 16k prompt of session 6 (bench/NOTES.md).
            self.stream.wait_stream(torch.cuda.current_stream(device))
            self.free = [None] * n                  # after the kernels that read the slot last
            self.ready = [None] * n                 # after the slot's copy

    @property
    def runs_ok(self) -> bool:
        return self.rows.runs_ok

    def copy(self, layer: int, experts, sources, slab_slots, after=None, events=None, taken=frozenset()) -> int:
        """Copy the blocks of slab slots `sources` into the next slots for `layer`'s `experts` (at most n), stopping
        before the first slot in `taken` (slots another layer still reads); `slab_slots` of those copied stay pinned
        until their copies are done. after: an event the copies wait for; events: (start, end) recorded around the
        copies alone (a profile). Returns how many (the first ones) were copied."""
        if len(experts) > self.n:
            raise ValueError(f"{len(experts)} blocks copied ahead into {self.n} slots")
        rs = self._take(len(experts), taken)
        k = len(rs)
        experts, slab_slots = list(experts)[:k], list(slab_slots)[:k]
        self.layer, self.table = layer, dict(zip(experts, rs))
        if k:
            self._put(rs, list(sources)[:k], after, events, "copies ahead")
            self.pins.add(self.ready[rs[-1]] if self.cuda else None, slab_slots)
        return k

    def copy_now(self, experts, sources, taken=frozenset()) -> dict:
        """Copy the blocks of slab slots `sources` for the current layer's `experts` into the next slots, stopping at
        the first slot in `taken` (the slots that layer still reads) or after n: {expert: slot} of those copied. The
        slab slots are the caller's to keep pinned; the table of blocks copied ahead is left as it is."""
        rs = self._take(min(len(experts), self.n), taken)
        if rs:
            self._put(rs, list(sources)[:len(rs)], None, None, "eager copies")
        return dict(zip(experts, rs))

    def put_into(self, layer: int, experts, sources, rs) -> None:
        """The blocks of slab slots `sources` into the given slots `rs` for `layer`'s `experts`, added to its table
        (the flow, gpu_worker/ahead_flow.py); the slab slots stay pinned until their copies are done."""
        if self.layer != layer:
            self.layer, self.table = layer, {}
        self.table.update(zip(experts, rs))
        self._put(list(rs), list(sources), None, None, "copies ahead")
        self.pins.add(self.ready[rs[-1]] if self.cuda else None, sources)

    def put_now(self, experts, sources, rs) -> dict:
        """The current layer's blocks (slab slots `sources`, the caller's to keep pinned) into the given slots `rs`
        now, outside the table: {expert: slot}."""
        self._put(list(rs), list(sources), None, None, "eager copies")
        return dict(zip(experts, rs))

    def _take(self, k: int, taken) -> list[int]:
        """The next k slots of the ring, up to the first one in `taken`; the ring moves past those."""
        rs = []
        for i in range(k):
            r = (self.next + i) % self.n
            if r in taken:
                break
            rs.append(r)
        self.next = (self.next + len(rs)) % self.n
        return rs

    def _put(self, rs, sources, after, events, what: str) -> None:
        """The blocks of slab slots `sources` into slots rs: on the CPU at once; on CUDA on this stream, after `after`
        and the kernels that read each slot last, with ready events (per run group or per block)."""
        if not self.cuda:
            self.rows.copy(self.buf, [self._row[r] for r in rs], sources, self.block_bytes, None, what)
            return
        cs = self.stream
        if after is not None:
            cs.wait_event(after)
        # the slots a launch read share its event: once per launch, not per slot (a 16k prompt copies ~400 blocks
        # ahead a layer, read by ~14 launches)
        wait_each_once(cs, (self.free[r] for r in rs))
        if events is not None:
            events[0].record(cs)
        if ahead_runs():
            self._copy_runs(rs, sources)
        else:
            for r, src in zip(rs, sources):
                self.rows.copy(self.buf, [self._row[r]], [src], self.block_bytes, cs, what)
                ev = torch.cuda.Event()
                ev.record(cs)
                self.ready[r] = ev
        if events is not None:
            events[1].record(cs)

    def _copy_runs(self, rs, sources) -> None:
        """MOESTREAM_AHEAD_RUNS: the copies in runs on the copy stream, an event after each group of at least
        AHEAD_EVENT_EVERY blocks (`ahead_copy_plan`)."""
        cs = self.stream
        brs = [self._row[r] for r in rs]          # the buffer's rows: runs where both sides are adjacent
        runs = copy_runs(sources, brs, self.rows.chunk) if self.rows.runs_ok else [(i, 1) for i in range(len(rs))]
        for group in ahead_copy_plan(split_runs(runs, ahead_run_max()), AHEAD_EVENT_EVERY):
            for i, k in group:
                self.rows.copy(self.buf, brs[i:i + k], sources[i:i + k], self.block_bytes, cs, "copies ahead")
            ev = torch.cuda.Event()
            ev.record(cs)
            for i, k in group:
                for q in range(i, i + k):
                    self.ready[rs[q]] = ev

    def address(self, r: int) -> int:
        return self._address[r]

    def view(self, r: int) -> torch.Tensor:
        return self.buf[self._row[r], :self.block_bytes]

    def wait(self, slots, cur=None) -> None:
        if self.cuda:
            cur = cur if cur is not None else torch.cuda.current_stream(self.device)
            # slots that share a ready event (MOESTREAM_AHEAD_RUNS) wait once
            wait_each_once(cur, (self.ready[r] for r in slots))

    def read_by_current_stream(self, slots, cur=None) -> None:
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(cur if cur is not None else torch.cuda.current_stream(self.device))
            for r in slots:
                self.free[r] = ev

    def releasable(self, wait: bool) -> list[int]:
        """The slab slots whose copies are done (wait: all of them, once done)."""
        return self.pins.releasable(wait)
