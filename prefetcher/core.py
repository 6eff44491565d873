"""The prefetcher: sole writer of the cache index.

It turns the compute process's per-layer messages into reads: the actual choice touches hits and
queues demand reads for misses; the guess for the next MoE layer queues prefetch reads. It hands
reads to the IO workers' rings (all demand reads at once; prefetch reads at most `prefetch_depth`
outstanding per worker, so a demand read never waits behind more than the read in progress), picks
slots (free first, then the policy's victim that is neither pinned nor loading) and tracks
prefetch used / wasted. Its queues are private: after a restart it rebuilds the index's view from
shared memory, and the client re-sends what it still waits for.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict, deque

import posix_ipc

from cache_shm.client import MSG_DEMAND, MSG_DEMOTE, MSG_LAYER, MSG_PREFILL, MSG_WARM, decode_message
from cache_shm.ring import full_fence
from cache_shm.shm import (DEMAND, DONE, EMPTY, FAILED, HDR, INF, LOADING, PFC, PREFETCH, READY,
                           REQ, CacheShm)

from .policy import make_policy

PREFILL_READS = ("as_slots_free", "at_once")
REFUSED = -2          # _allocate: the policy did not admit the read ahead (not a slot)


class Prefetcher:
    def __init__(self, shm: CacheShm, policy: str = "reuse", parent_pid: int | None = None,
                 prefill_reads: str | None = None):
        """prefill_reads: "as_slots_free" (a prefill's reads wait for slots the prompt is done with, see
        `_allocate`), or "at_once" (every read gets a slot when it is queued: spent blocks first, then the layer's
        unasked ones, then plain LRU; the rule before but for its scan bound, kept as the tests' twin and for
        measurement). Default: $MOESTREAM_PREFILL_READS, else as_slots_free."""
        self.shm = shm
        self.E = shm.n_experts
        self.policy = make_policy(policy, shm.n_layers, shm.n_experts)
        self._observe = getattr(self.policy, "observe", None)
        self._to_observe: list = []      # layer messages the policy has not learned from yet (`dispatch`)
        self._admit = getattr(self.policy, "admit", None)
        self.parent_pid = parent_pid
        self.depth = int(shm.cfg["prefetch_depth"])
        self.c = shm.pf_counters
        self.free: deque[int] = deque()
        self.pending_demand: OrderedDict[int, None] = OrderedDict()    # key -> None, FIFO
        self.pending_prefetch: OrderedDict[int, None] = OrderedDict()
        self.pending_warm: OrderedDict[int, None] = OrderedDict()     # warm reads: free slots, nothing else waiting
        self.warming: set[int] = set()               # slots a warm read is filling
        self.outstanding = [dict() for _ in range(shm.n_workers)]      # slot -> (gen, kind)
        self.prefetched_unused: set[int] = set()    # ready slots a prefetch filled, not yet used
        self.credited: set[int] = set()              # loading prefetch slots already counted used
        self.prefill_loaded: set[int] = set()        # keys read for a prefill, not yet used by decode
        self.prefill_layer: int | None = None        # the MoE layer a prefill is at (None: decoding)
        if prefill_reads is None:
            prefill_reads = os.environ.get("MOESTREAM_PREFILL_READS", "as_slots_free")
        if prefill_reads not in PREFILL_READS:
            raise ValueError(f"prefill reads {prefill_reads!r}: one of {PREFILL_READS}")
        self.prefill_reads = prefill_reads
        # what the prompt has passed (layers before prefill_layer) or is done with (prefill_layer's blocks it
        # reported back), in the order it got so: the blocks it loaded itself first, then the rest
        self._spent_loaded: deque[tuple[int, int]] = deque()     # (slot, key)
        self._spent_other: deque[tuple[int, int]] = deque()
        self._spent_keys: set[int] = set()
        self._spent_pinned = 0
        self._waiting_spent = False          # a demand read waits for a spent slot (see _allocate)
        self._want: set[int] = set()         # keys of prefill_layer the prompt asked for
        self._done: set[int] = set()         # of those, the ones it is done with
        self.min_inflight = 2 * shm.n_workers
        self._rr = 0
        self._rebuild()
        shm.hdr[HDR["prefetcher_pid"]] = os.getpid()
        shm.hdr[HDR["epoch"]] += 1                   # tells clients to re-send what they wait for

    # ---- recovery --------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Derive free list, policy order and outstanding reads from the shared index. A loading
        slot that no ring or in-flight record holds (a crash between assign and push) is reset."""
        shm = self.shm
        owned = {}
        for w in range(shm.n_workers):   # rings first, then in-flight records (a worker writes
            for ring in (shm.demand_rings[w], shm.prefetch_rings[w]):   # in-flight before it frees a record)
                for rec in ring.pending():
                    gen, slot, _, _, kind, _ = REQ.unpack(rec)
                    owned[slot] = (w, gen, kind)
        for w in range(shm.n_workers):
            f = shm.inflight[w]
            if f[INF["valid"]]:
                owned[int(f[INF["slot"]])] = (w, int(f[INF["gen"]]), int(f[INF["kind"]]))
        soe, key, state, gen = shm.slot_of_expert.reshape(-1), shm.slot_key, shm.slot_state, shm.slot_gen
        rdy = shm.ready_of_expert.reshape(-1)
        for s in range(shm.n_slots):
            k, st = int(key[s]), int(state[s])
            if k >= 0 and st in (READY, FAILED):
                soe[k] = s
                if st == READY:
                    rdy[k] = s
                self.policy.insert(s, k)
            elif k >= 0 and st == LOADING and s in owned and owned[s][1] == int(gen[s]):
                w, g, kind = owned[s]
                soe[k] = s
                self.outstanding[w][s] = (g, kind)
            else:
                if k >= 0 and soe[k] == s:
                    soe[k] = -1
                if k >= 0 and rdy[k] == s:
                    rdy[k] = -1
                key[s] = -1
                gen[s] += 1
                state[s] = EMPTY
                self.free.append(s)
        for k in (soe >= 0).nonzero()[0]:       # entries that point at a slot holding another key
            if key[soe[k]] != k:
                soe[k] = -1
        for k in (rdy >= 0).nonzero()[0]:       # a worker writes state READY before rdy
            if key[rdy[k]] != k or state[rdy[k]] != READY:
                rdy[k] = -1

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        shm = self.shm
        while True:
            stalled = bool(self.pending_demand) and not self.free and not self._waiting_spent
            try:
                shm.sem_prefetcher.acquire(0.002 if stalled else 0.05 if self._waiting_spent else 0.2)
            except posix_ipc.BusyError:
                pass
            self.step()
            if shm.hdr[HDR["stopping"]] or (self.parent_pid and os.getppid() != self.parent_pid):
                return

    def step(self) -> None:
        shm = self.shm
        for w in range(shm.n_workers):
            ring = shm.done_rings[w]
            while (rec := ring.pop()) is not None:
                self._on_done(w, rec)
        while (m := shm.msg_ring.pop()) is not None:
            self._on_message(decode_message(m))
        self.dispatch()
        self.c[PFC["demand_queue"]] = len(self.pending_demand) + sum(
            1 for o in self.outstanding for g, k in o.values() if k == DEMAND)
        self.c[PFC["prefetch_queue"]] = len(self.pending_prefetch) + sum(
            1 for o in self.outstanding for g, k in o.values() if k == PREFETCH)

    # ---- events ----------------------------------------------------------------------------
    def _on_done(self, w: int, rec: bytes) -> None:
        gen, slot, ok, kind = DONE.unpack(rec)
        shm = self.shm
        o = self.outstanding[w].pop(slot, None)
        st, k = int(shm.slot_state[slot]), int(shm.slot_key[slot])
        if o is None or o[0] != gen:      # a duplicate from a restarted worker, or from before our restart
            if st in (READY, FAILED) and k >= 0 and slot not in self.policy:
                self.policy.insert(slot, k)
            return
        if st not in (READY, FAILED):
            return
        self.policy.insert(slot, k)
        if slot in self.warming:         # a warm read: neither a read ahead used nor one wasted
            self.warming.discard(slot)
            self.c[PFC["failed_slots" if st == FAILED else "warm_reads"]] += 1
            return
        if st == FAILED:
            self.c[PFC["failed_slots"]] += 1
        elif kind == PREFETCH:
            if slot in self.credited:
                self.credited.discard(slot)
            else:
                self.prefetched_unused.add(slot)

    def _on_message(self, msg) -> None:
        kind, layer, actual, guess_layer, guess = msg
        shm, E = self.shm, self.E
        soe = shm.slot_of_expert
        self.c[PFC["messages"]] += 1
        if kind == MSG_WARM:
            for e in actual:
                if soe[layer, e] < 0:
                    self.pending_warm[layer * E + e] = None
            return
        if kind == MSG_DEMAND:
            for e in actual:
                k = layer * E + e
                if soe[layer, e] < 0 and k not in self.pending_demand:
                    self.pending_prefetch.pop(k, None)
                    self.pending_demand[k] = None
            return
        if kind == MSG_PREFILL:
            self._enter_prefill_layer(layer)
            self._want.update(layer * E + e for e in actual)
            for e in actual:
                k = layer * E + e
                if soe[layer, e] < 0:
                    self.c[PFC["misses"]] += 1
                    self.pending_prefetch.pop(k, None)
                    if k not in self.pending_demand:
                        self.pending_demand[k] = None
                        self.prefill_loaded.add(k)
                else:
                    self.c[PFC["hits"]] += 1     # resident: used as is, its place in the order kept
                    s = int(soe[layer, e])
                    if s in self.prefetched_unused:      # a prefill guess that came true
                        self.prefetched_unused.discard(s)
                        self.c[PFC["prefetch_used"]] += 1
            for e in guess:                      # the next layer's likely experts: prefetch reads
                k = guess_layer * E + e
                if soe[guess_layer, e] < 0 and k not in self.pending_demand and k not in self.pending_prefetch:
                    self.pending_prefetch[k] = None
                    self.prefill_loaded.add(k)   # demoted like the prompt's demand reads once used
            return
        if kind == MSG_DEMOTE:
            j = self.prefill_layer
            for e in actual:
                k = layer * E + e
                s = int(soe[layer, e])
                loaded = k in self.prefill_loaded
                if loaded:
                    self.prefill_loaded.discard(k)
                    if s >= 0:
                        self.policy.demote(s)
                if j is not None and layer <= j:
                    if layer == j:
                        self._done.add(k)
                    if s >= 0:
                        self._spend(s, k, loaded)
            return
        assert kind == MSG_LAYER, f"unknown message kind {kind}"
        if self.prefill_layer is not None:
            self._reset_prefill()
            self.prefill_layer = None
        if self._observe is not None:            # a policy that learns from the layer message (ReusePolicy): after
            self._to_observe.append((layer, actual, guess_layer, guess))     # this step's demand reads (dispatch)
        for e in actual:
            k = layer * E + e
            self.prefill_loaded.discard(k)      # decode uses it: an ordinary resident now
            s = int(soe[layer, e])
            if s >= 0:
                st = int(shm.slot_state[s])
                if st == LOADING:
                    self.c[PFC["misses_inflight"]] += 1
                    if self._loading_kind(s) == PREFETCH and s not in self.credited:
                        self.credited.add(s)
                        self.c[PFC["prefetch_used"]] += 1
                    continue
                if st == READY:
                    self.c[PFC["hits"]] += 1
                self.policy.touch(s, k)
                if s in self.prefetched_unused:
                    self.prefetched_unused.discard(s)
                    self.c[PFC["prefetch_used"]] += 1
            else:
                self.c[PFC["misses"]] += 1
                self.pending_prefetch.pop(k, None)
                self.pending_demand[k] = None
        # Guesses for this layer that were never dispatched are moot now that the layer has run.
        stale = [k for k in self.pending_prefetch if k // E == layer]
        for k in stale:
            del self.pending_prefetch[k]
        self.c[PFC["prefetch_cancelled"]] += len(stale)
        for e in guess:
            k = guess_layer * E + e
            s = int(soe[guess_layer, e])
            if s >= 0:
                if int(shm.slot_state[s]) == READY:
                    self.policy.touch(s, k)      # keep a guessed resident expert for the next layer
            elif k not in self.pending_demand and k not in self.pending_prefetch:
                self.pending_prefetch[k] = None

    def _loading_kind(self, slot: int) -> int | None:
        for o in self.outstanding:
            if slot in o:
                return o[slot][1]
        return None

    # ---- reads -----------------------------------------------------------------------------
    def dispatch(self) -> None:
        shm = self.shm
        self._waiting_spent = False
        while self.pending_demand:
            ws = [w for w in range(shm.n_workers) if len(shm.demand_rings[w]) < shm.demand_rings[w].capacity]
            if not ws:
                break
            s = self._allocate()
            if s is None:
                self.c[PFC["stalls_no_slot"]] += 1
                break
            k, _ = self.pending_demand.popitem(last=False)
            self._rr += 1      # ties go round-robin so idle workers share the reads
            w = min(ws, key=lambda w: (len(self.outstanding[w]), (w - self._rr) % shm.n_workers))
            self._assign(s, k, DEMAND, w)
            self.c[PFC["demand_reads"]] += 1
        # The policy learns from the layer messages once their demand reads are out (ReusePolicy.observe: ~0.1 ms a
        # message at Super's scale, off the path of the reads the decode waits for) and before their reads ahead,
        # whose admission needs the guess it was just told.
        if self._to_observe:
            for msg in self._to_observe:
                self._observe(*msg)
            self._to_observe.clear()
        held = self._held()                        # (nothing below makes a demand read: once a pass is enough)
        if held and self.pending_prefetch:
            self.c[PFC["prefetch_held"]] += 1      # the next done record or message dispatches them
        while self.pending_prefetch and not held:
            w = self._ahead_worker()
            if w is None:
                break
            s = self._allocate(PREFETCH, key=next(iter(self.pending_prefetch)))
            if s is None:
                break
            k, _ = self.pending_prefetch.popitem(last=False)
            if s == REFUSED:
                self.c[PFC["prefetch_refused"]] += 1
                continue
            self._assign(s, k, PREFETCH, w)
            self.c[PFC["prefetch_issued"]] += 1
        # warm reads last, into free slots only (never a victim), at the reads-ahead depth, while nothing else waits
        soe = shm.slot_of_expert.reshape(-1)
        while self.pending_warm and self.free and not self.pending_demand and not self.pending_prefetch:
            w = self._ahead_worker()
            if w is None:
                break
            k, _ = self.pending_warm.popitem(last=False)
            if soe[k] >= 0:              # read meanwhile (a demand, a read ahead)
                continue
            s = self.free.popleft()
            self.warming.add(s)
            self._assign(s, k, PREFETCH, w)

    def _held(self) -> bool:
        """Reads ahead wait: the compute process asked for it (`CacheClient.hold_ahead`), a decode is running (not a
        prefill) and a demand read is pending or out."""
        return (bool(self.shm.hdr[HDR["hold_ahead"]]) and self.prefill_layer is None
                and (bool(self.pending_demand)
                     or any(kd == DEMAND for o in self.outstanding for _, kd in o.values())))

    def _ahead_worker(self) -> int | None:
        """The IO worker with the fewest reads ahead (and warm reads) outstanding, ties round-robin; None when even
        it has the reads-ahead depth."""
        n = self.shm.n_workers
        counts = [sum(1 for g, kd in self.outstanding[w].values() if kd == PREFETCH) for w in range(n)]
        self._rr += 1
        w = min(range(n), key=lambda w: (counts[w], len(self.outstanding[w]), (w - self._rr) % n))
        return None if counts[w] >= self.depth else w

    def _assign(self, s: int, k: int, kind: int, w: int) -> None:
        shm = self.shm
        shm.slot_state[s] = LOADING
        shm.slot_key[s] = k
        shm.slot_gen[s] += 1
        gen = int(shm.slot_gen[s])
        shm.ready_of_expert.reshape(-1)[k] = -1
        shm.slot_of_expert.reshape(-1)[k] = s
        ring = shm.demand_rings[w] if kind == DEMAND else shm.prefetch_rings[w]
        ok = ring.push(REQ.pack(gen, s, k // self.E, k % self.E, kind, time.monotonic_ns()))
        assert ok, "ring space was checked"
        self.outstanding[w][s] = (gen, kind)
        shm.sem_workers[w].release()

    def _evictable(self, s: int) -> bool:
        return self.shm.slot_pins[s] == 0 and self.shm.slot_state[s] in (READY, FAILED)

    # ---- slots for a prefill's reads -------------------------------------------------------
    # A prefill runs the prompt through one MoE layer at a time and uses each block once there. The blocks a read
    # may take without costing the prompt a re-read are those of layers it has passed and those of its current
    # layer it reported done (MSG_DEMOTE, sent once it has unpinned them, or, for a layer's last few, just before
    # the next layer's request): `_spent_*`, the ones it loaded itself first. A block of the current layer it still
    # needs, or of a later layer, is kept. On the H200 (16k tokens, a third of the experts cached) 476 of 1,747
    # reads were such blocks evicted by earlier reads; on the CPU (bench/NOTES.md, session 4) nearly all at MoE
    # layer 0, where every miss got its slot the moment it was queued while the only evictable blocks were later
    # layers' (the layer's hits were still pinned), and a scan bound on the later-layer filter of the rule before
    # let the same through elsewhere. So while no spent block is free, a read waits, as long as `min_inflight` of
    # the current layer's blocks (or as many as reads wait, if fewer) are in flight or in use: they come back.
    # Below that a read goes ahead into a block the layer did not ask for, else the least recent (a later
    # layer's), so that the disk never idles for want of a slot. What ends a wait comes with a message (done, or
    # the next request), so the loop then sleeps on its semaphore instead of polling for pins.
    def _enter_prefill_layer(self, j: int) -> None:
        old = self.prefill_layer
        if old == j:
            return
        new_prompt = old is None or j < old      # (or a new span of the same prompt): nothing is spent yet
        if new_prompt:
            self._reset_prefill()
        lo = 0 if new_prompt else old
        # guesses for layers the prompt has passed (or, at a new prompt, for the last one) that were never dispatched
        # are moot: dispatched later they would only be read for nobody, and counted to the next prompt
        stale = [k for k in self.pending_prefetch if new_prompt or k // self.E < j]
        for k in stale:
            del self.pending_prefetch[k]
        self.c[PFC["prefetch_cancelled"]] += len(stale)
        keys = self.shm.slot_key
        layer_of = keys // self.E
        for s in ((keys >= 0) & (layer_of >= lo) & (layer_of < j)).nonzero()[0].tolist():
            k = int(keys[s])
            self._spend(s, k, k in self.prefill_loaded)
        self.prefill_layer = j
        self._want, self._done = set(), set()

    def _reset_prefill(self) -> None:
        self._spent_loaded.clear()
        self._spent_other.clear()
        self._spent_keys.clear()
        self._want, self._done = set(), set()

    def _spend(self, s: int, k: int, loaded: bool) -> None:
        if k not in self._spent_keys:
            self._spent_keys.add(k)
            (self._spent_loaded if loaded else self._spent_other).append((s, k))

    def _take_spent(self) -> int | None:
        """An evicted slot from the spent blocks, or None (pinned ones wait at the back of their queue)."""
        key, state = self.shm.slot_key, self.shm.slot_state
        self._spent_pinned = 0
        for q in (self._spent_loaded, self._spent_other):
            for _ in range(len(q)):
                s, k = q.popleft()
                if int(key[s]) != k or state[s] not in (READY, FAILED):
                    self._spent_keys.discard(k)      # gone already (evicted, or read again elsewhere)
                    continue
                if self.shm.slot_pins[s] == 0 and self._evict(s):
                    self._spent_keys.discard(k)
                    return s
                self._spent_pinned += 1
                q.append((s, k))
        return None

    def _coming_back(self) -> int:
        """Slots that will be spent and free soon: the spent ones still pinned (reported done, kernels running; as
        counted by the last `_take_spent`) and the blocks of the prefill's layer it asked for, not yet reported
        done, that are loading or resident."""
        soe = self.shm.slot_of_expert.reshape(-1)
        return self._spent_pinned + sum(1 for k in self._want if k not in self._done and soe[k] >= 0)

    def _allocate(self, kind: int = DEMAND, key: int | None = None) -> int | None:
        """A slot for a read: free, spent by the prefill, or the policy's victim evicted; REFUSED when `key` (a read
        ahead at decode) is less likely used than the victim by the policy's own `admit`."""
        if self.free:
            return self.free.popleft()
        if self.prefill_layer is not None:
            s = self._take_spent()
            if s is not None:
                return s
            if self.prefill_reads == "as_slots_free" and (
                    kind == PREFETCH or self._coming_back() >= min(self.min_inflight, len(self.pending_demand))):
                self._waiting_spent = kind == DEMAND
                return None      # wait for a spent slot: the prompt needs every block it could evict now
        for _ in range(8):
            s = None
            if self.prefill_layer is not None:     # the layer's blocks the prompt did not ask for go first
                s = self.policy.choose_victim(self._unwanted_here)
            if s is None:
                s = self.policy.choose_victim(self._evictable)
            if s is None:
                return None
            if key is not None and self._admit is not None and self.prefill_layer is None \
                    and not self._admit(key, s):
                return REFUSED
            if self._evict(s):
                if self.prefill_layer is not None:
                    self.c[PFC["prefill_forced"]] += 1
                return s
        return None

    def _unwanted_here(self, s: int) -> bool:
        k = int(self.shm.slot_key[s])
        return k // self.E == self.prefill_layer and k not in self._want and self._evictable(s)

    def _evict(self, s: int) -> bool:
        """Unpublish and free slot s (evictable when chosen); False if the client pinned it in the race (then it
        is published again and stays)."""
        shm = self.shm
        soe, rdy = shm.slot_of_expert.reshape(-1), shm.ready_of_expert.reshape(-1)
        k, st = int(shm.slot_key[s]), int(shm.slot_state[s])
        rdy[k] = -1                 # unpublish, then look for a pin taken meanwhile
        soe[k] = -1
        shm.slot_gen[s] += 1
        shm.slot_state[s] = EMPTY
        full_fence()
        if shm.slot_pins[s] != 0:   # the client pinned it in the race: give it back
            shm.slot_state[s] = st
            soe[k] = s
            if st == READY:
                rdy[k] = s
            self.policy.touch(s, k)
            return False
        shm.slot_key[s] = -1
        self.policy.remove(s)
        self.c[PFC["evictions"]] += 1
        if s in self.prefetched_unused:
            self.prefetched_unused.discard(s)
            self.c[PFC["prefetch_wasted"]] += 1
        return True


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="moestream prefetcher process")
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--policy", default="reuse")   # bench/NOTES.md session 13 h-policy: its hit rates and cost
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)
    from procs.spawn import die_with_parent
    if not die_with_parent(args.parent_pid):
        return 0
    shm = CacheShm.attach(args.prefix)
    try:
        Prefetcher(shm, args.policy, args.parent_pid).run()
    finally:
        shm.close()
    return 0
