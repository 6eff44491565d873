"""The compute process's side of the cache: look up, send one message per MoE layer, wait, release.

Nothing here writes the index. A slot is used under a pin (`slot_pins`, written only here): the
prefetcher never evicts a pinned slot, and both sides use the store-fence-load pattern so that a
pin taken while the prefetcher evicts is seen by one side or the other:
  client:     read ready_of_expert -> pin -> fence -> read it again (changed: unpin, it is a miss)
  prefetcher: ready_of_expert = -1, bump gen -> fence -> read pins (pinned: publish again, next victim)
"""
from __future__ import annotations

import operator
import struct
import threading
import time

import msgpack
import numpy as np
import posix_ipc

from .names import pid_alive
from .shm import CLC, FAILED, HDR, PFC, STATE_NAMES, CacheShm

# message kinds: per-layer (actual + guess); demand only (a re-send); prefill (demand misses, touch
# nothing); demote (a prefill is done with these experts: move what it loaded to the cold end); warm (read into free
# slots while nothing else waits, never evicting: a cache that holds every expert filled at start)
MSG_LAYER, MSG_DEMAND, MSG_PREFILL, MSG_DEMOTE, MSG_WARM = 1, 2, 3, 4, 5
# Every message reads as [kind, layer, actual, guess_layer, guess] (`decode_message`). The decode's per-layer message
# (MSG_LAYER, on the route path) goes as a fixed record: a header "=BBHHH" (LAYER_RECORD_TAG, kind, layer, guess
# layer, the number of actual experts), then the actual and the guessed experts as u16 (the host's byte order: both
# ends share its memory, and the prefetcher reads the ids as one memoryview cast), packed straight into the
# ring's record by one cached Struct per id count. msgpack's pack and the push of its bytes cost the misses' request
# ~21 µs cold on the VM (bench/NOTES.md, "Session 12, h-misses"). The rest, and any layer message the record cannot
# carry (an id outside u16, too many ids), stay msgpack. The tag is msgpack's never-used byte: no msgpack message
# begins with it.
LAYER_RECORD_TAG = 0xC1
_LAYER_HEAD = struct.Struct("=BBHHH")
_LAYER_RECORDS: dict[int, struct.Struct] = {}


def layer_record(n_ids: int) -> struct.Struct:
    """The fixed record of a layer message carrying `n_ids` experts (actual + guess), made once per count."""
    st = _LAYER_RECORDS.get(n_ids)
    if st is None:
        st = _LAYER_RECORDS[n_ids] = struct.Struct(f"{_LAYER_HEAD.format}{n_ids}H")
    return st


def decode_message(rec: bytes) -> list:
    """A message from the ring as [kind, layer, actual, guess_layer, guess] (lists of ints), whichever form it went in."""
    if rec[0] != LAYER_RECORD_TAG:
        return msgpack.unpackb(rec)
    n_ids, odd = divmod(len(rec) - _LAYER_HEAD.size, 2)
    if odd or n_ids < 0:
        raise ValueError(f"a layer record of {len(rec)} bytes")
    _, kind, layer, guess_layer, n_actual = _LAYER_HEAD.unpack_from(rec)
    ids = memoryview(rec)[_LAYER_HEAD.size:].cast("H").tolist()
    if n_actual > n_ids:
        raise ValueError(f"a layer record of {n_ids} ids says {n_actual} are actual")
    return [kind, layer, ids[:n_actual], guess_layer, ids[n_actual:]]

LOOKUPS, LOOKUP_HITS, LOOKUP_MISSES, REQUESTS, WAITS, WAIT_NS, RESENDS = (
    CLC[n] for n in ("lookups", "lookup_hits", "lookup_misses", "requests", "waits", "wait_ns", "resends"))


class ExpertLoadError(RuntimeError):
    """A block could not be loaded (read error, short read, checksum mismatch)."""


class CacheUnavailable(RuntimeError):
    """The cache's processes are gone for good (their owner gave up restarting them): nothing will land."""


class CacheClient:
    def __init__(self, shm: CacheShm, resend_s: float = 0.5):
        self.shm = shm
        self.n_layers, self.n_experts = shm.n_layers, shm.n_experts
        self._soe = shm.slot_of_expert
        self._key, self._state, self._gen = shm.slot_key, shm.slot_state, shm.slot_gen
        # Per-element access through memoryviews: for top-22 a Python loop beats numpy's per-call
        # overhead (measured: ~5 us vs ~30 us per lookup).
        self._rdy_rows = [memoryview(shm.ready_of_expert[j]) for j in range(shm.n_layers)]
        self._pins = memoryview(shm.slot_pins)
        self._cc = memoryview(shm.client_counters)
        self._lock = threading.Lock()   # one writer of pins per process; its release is also the fence
        self._packer = msgpack.Packer()
        self._msg_ring = shm.msg_ring
        self._resend_s = resend_s
        self._owns_shm = False
        self.broken: str | None = None     # set by the owner when it gives up on the cache processes

    @classmethod
    def attach(cls, prefix: str, **kw) -> "CacheClient":
        c = cls(CacheShm.attach(prefix), **kw)
        c._owns_shm = True
        return c

    # ---- look up ---------------------------------------------------------------------------
    def _try_pin(self, layer: int, experts) -> dict[int, int]:
        """Pin every expert of `experts` that is ready now: {expert: slot}."""
        row, pins = self._rdy_rows[layer], self._pins
        with self._lock:
            got = {e: s for e in experts if (s := row[e]) >= 0}
            for s in got.values():
                pins[s] += 1
        # The lock release was a full fence: our pins are visible before we read again. An evicting
        # prefetcher unpublishes (ready_of_expert = -1) before it looks at pins, so either it sees
        # our pin or we see its unpublish. Same slot again = same block (a reload of the same key).
        lost = [e for e, s in got.items() if row[e] != s]
        if lost:
            with self._lock:
                for e in lost:
                    pins[got.pop(e)] -= 1
        return got

    def lookup(self, layer: int, experts) -> dict[int, int]:
        """{expert: slot} for the experts of `layer` that are ready now, each pinned (release later)."""
        experts = experts.tolist() if hasattr(experts, "tolist") else experts
        got = self._try_pin(layer, experts)
        cc = self._cc
        cc[LOOKUPS] += 1
        cc[LOOKUP_HITS] += len(got)
        cc[LOOKUP_MISSES] += len(experts) - len(got)
        return got

    def lookup_slots(self, layer: int, experts: list[int], count: bool = True) -> list[int]:
        """`lookup` aligned with `experts` (a list of ints), no dict built: the slot of each expert that is
        ready now, pinned, else -1. The decode route's fast path, where usually every expert is present.
        count=False: not a use (an early copy of guessed experts), so the hit counters do not move."""
        if not experts:
            if count:
                self._cc[LOOKUPS] += 1
            return []
        row = self._rdy_rows[layer]
        gather = operator.itemgetter(*experts)      # one C-level gather from the memoryview (a loop: 3× slower)
        slots = [gather(row)] if len(experts) == 1 else list(gather(row))
        return self._pin(row, gather, slots, count)

    def count_lookup(self, hits: int) -> None:
        """Count a lookup of `hits` experts that all hit, made without pins (blocks the caller holds pinned already:
        a layer routed on the device from the slab, gpu_worker/slab_routing.py)."""
        cc = self._cc
        cc[LOOKUPS] += 1
        cc[LOOKUP_HITS] += hits

    def lookup_all(self, layer: int, experts: list[int]) -> tuple[list[int], bool]:
        """`lookup_slots` if every expert is ready now: (slots, True), pinned and counted (a block unpublished before
        its pin is still a miss, -1). Otherwise nothing is pinned or counted: (the slots read, -1 where not ready,
        False), for a caller that sends its request before it pins (`lookup_slots` then). Such a read is a hint:
        a slot read without a pin may hold another block the moment after."""
        if not experts:
            return self.lookup_slots(layer, experts), True
        row = self._rdy_rows[layer]
        gather = operator.itemgetter(*experts)
        slots = [gather(row)] if len(experts) == 1 else list(gather(row))
        if -1 in slots:
            return slots, False
        return self._pin(row, gather, slots, True, True), True

    def _pin(self, row, gather, slots: list[int], count: bool, ready: bool = False) -> list[int]:
        """Pin the slots read (>= 0) by `gather` from `row`, then read again: an expert unpublished meanwhile is a
        miss (-1, its pin undone). ready: every slot read is >= 0 (`lookup_all`: the loops skip the test, and the
        counts the misses' scan unless one was unpublished; ~0.5 µs of the hits' ~4 on the VM)."""
        pins = self._pins
        with self._lock:
            if ready:
                for s in slots:
                    pins[s] += 1
            else:
                for s in slots:
                    if s >= 0:
                        pins[s] += 1
        # as in _try_pin: the lock release was the fence; an expert unpublished meanwhile is a miss
        again = [gather(row)] if len(slots) == 1 else list(gather(row))
        if again != slots:
            ready = False
            with self._lock:
                for i, (s, now) in enumerate(zip(slots, again)):
                    if s >= 0 and now != s:
                        pins[s] -= 1
                        slots[i] = -1
        if not count:
            return slots
        cc = self._cc
        cc[LOOKUPS] += 1
        if ready:
            cc[LOOKUP_HITS] += len(slots)
            return slots
        n_miss = slots.count(-1)
        cc[LOOKUP_HITS] += len(slots) - n_miss
        cc[LOOKUP_MISSES] += n_miss
        return slots

    def _failed(self, layer: int, e: int) -> int | None:
        s = int(self._soe[layer, e])
        if s >= 0 and self._state[s] == FAILED and self._key[s] == layer * self.n_experts + e:
            return s
        return None

    # ---- messages --------------------------------------------------------------------------
    def _pack(self, obj) -> bytes:
        """msgpack bytes of obj through the client's one Packer: `packb` makes a Packer and its buffer per call, which
        cost the misses' route path ~1.5 µs of its ~4.4 (bench.host_bookkeeping, VM). A failed pack leaves the
        Packer empty (msgpack resets it); the lock keeps one packing at a time."""
        with self._lock:
            return self._packer.pack(obj)

    def _send(self, payload: bytes, timeout: float = 10.0) -> None:
        ring = self.shm.msg_ring
        deadline = None
        with self._lock:
            while not ring.push(payload):
                if self.broken:
                    raise CacheUnavailable(self.broken)
                deadline = deadline or time.monotonic() + timeout
                if time.monotonic() > deadline:
                    raise TimeoutError("prefetcher message ring full: is the prefetcher running?")
                time.sleep(0.0002)
        self.shm.sem_prefetcher.release()

    def request(self, layer: int, actual, guess=(), guess_layer: int | None = None) -> None:
        """One message per MoE layer: the router's actual choice for `layer` (touch; misses become
        demand reads) and the guess for `guess_layer` (default: the next MoE layer; misses become
        prefetch reads). Experts: integers. A fixed record (`layer_record`) where it can carry them, else msgpack
        (Python ints packed as given, anything else converted; split over several records if too many)."""
        if guess_layer is None:
            guess_layer = (layer + 1) % self.n_layers
        try:
            n_ids = len(actual) + len(guess)
            st = _LAYER_RECORDS.get(n_ids) or layer_record(n_ids)      # (the call only the first time: ~1 µs cold)
            with self._lock:
                pushed = self._msg_ring.push_packed(st, LAYER_RECORD_TAG, MSG_LAYER, layer, guess_layer,
                                                       len(actual), *actual, *guess)
        except (struct.error, TypeError, ValueError):    # nothing written: an id a u16 cannot hold, too many ids
            pushed = None
        if pushed:
            self._cc[REQUESTS] += 1
            self.shm.sem_prefetcher.release()
            return
        if pushed is False:                               # the ring is full: the same record, once there is room
            self._cc[REQUESTS] += 1
            self._send(st.pack(LAYER_RECORD_TAG, MSG_LAYER, layer, guess_layer, len(actual), *actual, *guess))
            return
        self._request_msgpack(int(layer), actual, guess, guess_layer)

    def _request_msgpack(self, layer: int, actual, guess, guess_layer: int) -> None:
        guess_layer = int(guess_layer)
        try:     # the decode route's lists of Python ints go as they are (converting 44 ids was half this call's cost)
            msg = self._pack((MSG_LAYER, layer, actual, guess_layer, guess))
        except TypeError:                  # numpy or torch ints, a range, an array: as ints
            actual, guess = [int(e) for e in actual], [int(e) for e in guess]
            msg = self._pack((MSG_LAYER, layer, actual, guess_layer, guess))
        if len(msg) > self.shm.msg_ring.max_payload:   # a huge prefill set: split it
            actual, guess = [int(e) for e in actual], [int(e) for e in guess]
            half = max(len(actual), len(guess)) // 2
            self._request_msgpack(layer, actual[:half], guess[:half], guess_layer)
            self._request_msgpack(layer, actual[half:], guess[half:], guess_layer)
            return
        self._cc[REQUESTS] += 1
        self._send(msg)

    def hold_ahead(self, on: bool) -> None:
        """While decoding, the prefetcher starts no read ahead while a demand read is pending or out (the header's
        `hold_ahead`, read at each dispatch): the reads a layer waits for share the disk with fewer others. Session
        30's IO trace: a demand read took ~11 ms with the reads ahead around it, 1.5 ms on a quiet disk. A prefill's
        reads ahead are never held."""
        self.shm.hdr[HDR["hold_ahead"]] = int(bool(on))

    def request_prefill(self, layer: int, experts, guess=(), guess_layer: int = 0) -> None:
        """A prefill span needs `experts` of `layer`: misses become demand reads, hits are not
        promoted, so a long prompt does not push the decode working set out of the cache. `guess`:
        experts of `guess_layer` it will likely need next (prefetch reads, demoted like the rest once used)."""
        experts = [int(e) for e in experts]
        guess = [int(e) for e in guess]
        for s in range(0, max(len(experts), len(guess)), 256):     # keep each message well under the ring's record size
            self._cc[REQUESTS] += 1
            self._send(msgpack.packb((MSG_PREFILL, int(layer), experts[s:s + 256], int(guess_layer),
                                      guess[s:s + 256])))

    def done_prefill(self, layer: int, experts) -> None:
        """The prefill chunk is done with `experts`: the ones it loaded go to the eviction end."""
        experts = [int(e) for e in experts]
        for s in range(0, len(experts), 256):
            self._send(msgpack.packb((MSG_DEMOTE, int(layer), experts[s:s + 256], 0, [])))

    def demand(self, layer: int, experts) -> None:
        """Demand reads without a touch (wait() re-sends with this after a prefetcher restart)."""
        self._send(msgpack.packb((MSG_DEMAND, int(layer), [int(e) for e in experts], 0, [])))

    def warm(self, layer: int, experts) -> None:
        """Read `experts` of `layer` into free slots while no demand read or read ahead waits; never evicts (a
        cache that holds the whole store, filled while the model loads: its first prompts read nothing from disk)."""
        experts = [int(e) for e in experts]
        for s in range(0, len(experts), 256):
            self._send(msgpack.packb((MSG_WARM, int(layer), experts[s:s + 256], 0, [])))

    # ---- wait ------------------------------------------------------------------------------
    def wait(self, layer: int, expert: int, timeout: float = 60.0) -> int:
        """The slot of (layer, expert) once ready, pinned; raises ExpertLoadError with the reason
        if its read failed, TimeoutError after `timeout` seconds."""
        for e, s in self.wait_any(layer, [expert], timeout):
            return s
        raise AssertionError("unreachable")

    def wait_any(self, layer: int, experts, timeout: float = 60.0, idle=None):
        """Yield (expert, slot) for each of `experts` as it becomes ready (pinned), in landing order. `idle()`, if
        given, is called whenever none is ready, before waiting (a prefill hands back what it is done with there:
        the prefetcher may be holding a read until a slot comes back)."""
        left = list(dict.fromkeys(experts.tolist() if hasattr(experts, "tolist") else experts))
        t0 = time.monotonic()
        deadline = t0 + timeout
        epoch = int(self.shm.hdr[HDR["epoch"]])
        last_send = t0
        self._cc[WAITS] += 1
        try:
            while left:
                got = self._try_pin(layer, left)
                if got:
                    left = [e for e in left if e not in got]
                    yield from got.items()
                    continue
                if idle is not None:
                    idle()
                    got = self._try_pin(layer, left)
                    if got:
                        left = [e for e in left if e not in got]
                        yield from got.items()
                        continue
                for e in left:
                    s = self._failed(layer, e)
                    if s is not None:
                        raise ExpertLoadError(f"layer {layer} expert {e}: {self.shm.fail_reason(s)}")
                if self.broken:
                    raise CacheUnavailable(self.broken)
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(self._diagnose(layer, left, timeout))
                try:
                    self.shm.sem_ready.acquire(min(0.05, max(deadline - now, 0.001)))
                except posix_ipc.BusyError:
                    pass
                new_epoch = int(self.shm.hdr[HDR["epoch"]])
                absent = [e for e in left if self._soe[layer, e] < 0]
                # A restarted prefetcher lost its queued demands; re-send what is still absent.
                if new_epoch != epoch or (absent and time.monotonic() - last_send > self._resend_s):
                    epoch, last_send = new_epoch, time.monotonic()
                    self._cc[RESENDS] += 1
                    self.demand(layer, absent or left)
        finally:
            self._cc[WAIT_NS] += int((time.monotonic() - t0) * 1e9)

    def _diagnose(self, layer: int, left, timeout: float) -> str:
        e = int(left[0])
        s = int(self._soe[layer, e])
        state = STATE_NAMES.get(int(self._state[s]), "?") if s >= 0 else "not in cache"
        pid = int(self.shm.hdr[HDR["prefetcher_pid"]])
        alive = "alive" if pid > 0 and pid_alive(pid) else "DEAD"
        return (f"layer {layer} experts {list(left)[:8]} not ready after {timeout:.1f} s: expert {e} "
                f"slot {s} {state}; prefetcher pid {pid} {alive}; demand queue "
                f"{int(self.shm.pf_counters[PFC['demand_queue']])}")

    # ---- use and release -------------------------------------------------------------------
    def view(self, slot: int) -> np.ndarray:
        """uint8 view of the block in `slot`; valid while the slot is pinned."""
        return self.shm.slab[slot, :self.shm.block_bytes]

    def pin_again(self, slots) -> None:
        """One more pin on each of `slots`, which the caller holds pinned already (its block cannot change meanwhile):
        for a second user of the block that lets go on its own time (a copy on another stream)."""
        pins = self._pins
        with self._lock:
            for s in slots:
                pins[s] += 1

    def release(self, slots) -> None:
        """Unpin slots returned by lookup/wait (one release per pin): a slot, or an iterable of them."""
        pins = self._pins
        with self._lock:
            if isinstance(slots, (int, np.integer)):
                pins[int(slots)] -= 1
            else:
                for s in slots:
                    pins[s] -= 1

    def stats(self) -> dict:
        return self.shm.stats()

    def close(self) -> None:
        if self._owns_shm:
            self.shm.close()
