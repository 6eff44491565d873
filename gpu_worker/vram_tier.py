"""The VRAM tier of the expert cache: whatever `--vram-gb` leaves after the dense part holds hot expert blocks
on the device, so a 12–24 GB card gets faster without new flags.

Admission is by frequency, so the tier cannot thrash. Every use of an expert (a hit here or a use from the
slab) adds to its decayed use count, kept on the host (half-life `half_life_tokens` decode tokens; a token is
a lookup of MoE layer 0). An expert is a candidate once it has been used `admit_after` times (so one-off
experts of a single token do not take free slots); while slots are free a candidate enters, and once the tier
is full it enters only if its count *before this use* beats the coldest resident's count, which it then
evicts. The margin of one use is what stops the churn: on a trace whose working set is larger than the tier
(an 8 GB card: 0.5–1.9 GiB of tier against 880 blocks per Super token) the expert just used is always the most
recent, and a recency rule (the former second-use admission with LRU eviction) copied a block for ~0.9 of the
uses while serving ~0 % of them (bench/NOTES.md). Here the residents converge to the most used experts and the
copies stop. A copy is made only on admission: device-side from the pinned slab slot the block was just
computed from; the slot's pin is held until that copy has completed.

Device routing (gpu_worker/decode_graphs.py). The tier keeps `table` [n_layers, n_experts] int64 on the device: each
resident's block address, 0 where absent, written in stream order at every admission and eviction. A layer whose
every expert is resident ("complete") needs no host decision: the decode graphs gather its blocks' addresses from
its row by the router's top-k. Two rules keep that safe:
- `hold()` at the start of a token names the complete layers the token routes on the device; until `hold()` is
  called again (with nothing at the token's end), no eviction may take a resident of a held layer (a graph queued
  later in the token would read the slot's new block). An admission that would is refused and its victim's layer
  *yields*: the next `hold()` leaves it out, so it runs host-routed for one token, during which the eviction goes
  ahead (the tier's policy is delayed one token, not changed).
- filling: while the free slots can take every missing expert of a layer (`fillable`), the compute process copies
  them in from the slab (a bounded number per token, gpu_worker/streaming.py), so a tier that can hold a layer whole gets it whole: frequency admission
  alone would leave the experts the router rarely picks outside it for ever. A tier smaller than a layer (an 8 GB
  card) never fills, and its policy is the one above.
"""
from __future__ import annotations

import heapq
from itertools import repeat

import torch

# scores grow by a factor per token instead of all of them decaying; rescaled before floats overflow
_RESCALE_AT = 1e150
_EMPTY: dict = {}      # an absent layer's row (never written)


class VramTier:
    def __init__(self, n_slots: int, block_stride: int, block_bytes: int, device, admit_after: int = 2,
                 half_life_tokens: float = 256.0, n_layers: int = 0, n_experts: int = 0):
        """n_layers, n_experts: the MoE layers' shape, for the device table and whole-layer filling (0: neither)."""
        if admit_after < 1:
            raise ValueError(f"admit_after must be >= 1, got {admit_after}")
        if not half_life_tokens > 0:
            raise ValueError(f"half_life_tokens must be > 0 (math.inf: no decay), got {half_life_tokens}")
        self.device = torch.device(device)
        self.n_slots, self.block_bytes = n_slots, block_bytes
        self.buf = torch.empty((n_slots, block_stride), dtype=torch.uint8, device=self.device)
        # slot addresses by arithmetic: `buf[slot].data_ptr()` is a tensor op, ~2 µs per expert on the route path
        self.base_address, self.slot_stride = self.buf.data_ptr(), block_stride
        self.slot_of: dict[tuple[int, int], int] = {}
        # the route path's view of the same residents, and the counts, per MoE layer with int keys: a (layer,
        # expert) tuple built and hashed per expert cost ~0.5 µs of the ~20 µs `lookup` took for 22 experts
        # (bench.host_bookkeeping, vram scenario, session 9)
        self._rows: dict[int, dict[int, int]] = {}        # layer -> {expert: slot}
        self.free = list(range(n_slots - 1, -1, -1))
        self._uses: dict[int, dict[int, int]] = {}        # layer -> raw use counts: the `admit_after` gate
        self._sc: dict[int, dict[int, float]] = {}        # layer -> decayed use counts, in units of this token's weight
        self.admit_after = admit_after
        self._growth = 2.0 ** (1.0 / half_life_tokens)      # 1.0 for math.inf: plain counts
        self._w = 1.0                                        # the weight of a use at this token
        # one (score when pushed, key) per resident; a resident's score only grows, so an entry may be stale
        # (too low) but never too high: the top is fixed up lazily in `_coldest`
        self._heap: list[tuple[float, tuple[int, int]]] = []
        self.hits = self.admissions = self.evictions = 0
        self.n_experts = n_experts
        self.table = (torch.zeros((n_layers, n_experts), dtype=torch.int64, device=self.device)
                      if n_layers and n_experts else None)
        self.resident = [0] * n_layers                     # residents per layer: complete at n_experts
        self.held: frozenset[int] = frozenset()            # layers the current token routes on the device
        self._yielding: set[int] = set()                   # held layers an admission wanted to evict from
        self.refused = 0                                   # admissions put off a token by a held victim
        self.lent = 0                                      # slots lent out (`lend`), neither free nor resident
        self.lent_evictions = 0                            # residents evicted to lend their slots
        self.lent_keys: list[tuple[int, int]] = []         # ... which (layer, expert), until `take_lent_keys`
        # (layer, experts, their slots or -1) of the last `lookup_slots`: the uses it found, not yet added to the
        # counts (the decode route adds them after the launch); added first by whatever reads or changes the counts
        self._unscored: tuple | None = None
        # the copies on a copy stream (`set_copy_stream`): admitted blocks whose copy is queued there, in batches of
        # (event, [(key, slot)]) that become residents at `settle` once the event has passed; `_open`: not yet sealed
        self.copy_stream = None
        self._open: list[tuple[tuple[int, int], int]] = []
        self._inflight: list[tuple[object, list[tuple[tuple[int, int], int]]]] = []
        self._inflight_keys: set[tuple[int, int]] = set()

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    @property
    def score(self) -> dict[tuple[int, int], float]:
        """Every counted expert's decayed use count by (layer, expert): a copy, for reading."""
        self.score_uses()
        return {(j, e): v for j, row in self._sc.items() for e, v in row.items()}

    def row(self, j: int) -> dict[int, int]:
        """{expert: slot} of layer j's residents (the tier's own map: read it, do not change it)."""
        return self._rows.get(j, _EMPTY)

    def lookup(self, j: int, experts: list[int]) -> dict[int, int]:
        """{expert: vram slot} of the experts resident on the device (counts their uses)."""
        self.score_uses()
        if j == 0:
            self._tick()
        row = self._rows.get(j)
        if not row:
            return {}
        got = {e: row[e] for e in experts if e in row}
        if got:
            sc, w = self._sc[j], self._w
            for e in got:
                sc[e] += w
            self.hits += len(got)
        return got

    def lookup_slots(self, j: int, experts: list[int]) -> list[int] | None:
        """`lookup` aligned with `experts`, for the decode route: each one's VRAM slot, -1 where absent; None where
        none is resident. Its uses are added to the counts by `score_uses` (or by the next call that reads or
        changes them), so the route can add them after the launch: the decisions are those of `lookup`. One
        `dict.get` per expert in C and no float updates before the launch: `lookup` + the route's own pass over
        the hits cost ~15 of the vram scenario's ~22 µs critical path (bench.host_bookkeeping, VM, session 10)."""
        self.score_uses()
        if j == 0:
            self._tick()
        row = self._rows.get(j)
        if not row:
            return None
        slots = list(map(row.get, experts, repeat(-1)))
        n = len(slots) - slots.count(-1)
        if not n:
            return None
        self.hits += n
        self._unscored = (j, experts, slots)
        return slots

    def score_uses(self) -> None:
        """Add the uses the last `lookup_slots` found to the counts (a no-op once added)."""
        u = self._unscored
        if u is None:
            return
        self._unscored = None
        j, experts, slots = u
        sc, w = self._sc[j], self._w
        for e, s in zip(experts, slots):
            if s >= 0:
                sc[e] += w

    def block(self, slot: int) -> torch.Tensor:
        return self.buf[slot, :self.block_bytes]

    def address(self, slot: int) -> int:
        return self.base_address + slot * self.slot_stride

    def want(self, j: int, e: int) -> bool:
        """Count a use from the slab; True if the expert should now be admitted (see the module docstring)."""
        if self.n_slots == 0:
            return False
        self.score_uses()
        uses = self._uses.get(j)
        if uses is None:
            uses = self._uses[j] = {}
        n = uses.get(e, 0) + 1
        uses[e] = n
        sc = self._sc.get(j)
        if sc is None:
            sc = self._sc[j] = {}
        before = sc.get(e, 0.0)
        sc[e] = before + self._w
        if n < self.admit_after or e in self._rows.get(j, _EMPTY):
            return False
        if self._inflight_keys and (j, e) in self._inflight_keys:     # on its way in
            return False
        if self.free:
            return True
        victim = self._coldest()
        if not before > self._sc[victim[0]][victim[1]]:
            return False
        if victim[0] in self.held:        # a graph queued later in this token may read that slot
            self._yielding.add(victim[0])
            self.refused += 1
            return False
        return True

    def admit(self, j: int, e: int, src: torch.Tensor) -> None:
        """Copy a block (a U8 view of a pinned slab slot) into the tier, evicting the coldest resident. With a copy
        stream the copy is queued there, after everything queued on the current stream so far (kernels that may read
        the victim's slot, its table write), and the block becomes a resident at the `settle` after its batch's
        `seal`; the slab slot must stay pinned until that batch's event (the caller's)."""
        self.score_uses()
        k = (j, e)
        if self.free:
            s, evicted = self.free.pop(), False
        else:
            victim = self._coldest()
            if victim[0] in self.held:
                raise RuntimeError(f"VRAM tier: evicting expert {victim[1]} of MoE layer {victim[0]}, which this "
                                   "token routes on the device")
            heapq.heappop(self._heap)
            s, evicted = self._evict(victim), True
        if self.copy_stream is None:
            self.buf[s, :self.block_bytes].copy_(src, non_blocking=True)
            self._resident(k, s)
            return
        cs = self.copy_stream
        if evicted or not self._open:
            cs.after_current()
        with cs.queue():
            self.buf[s, :self.block_bytes].copy_(src, non_blocking=True)
        self._open.append((k, s))
        self._inflight_keys.add(k)

    def seal(self):
        """The copies queued since the last seal made one batch: its event (recorded on the copy stream), or None
        where there were none (or no copy stream: the copies are in the current stream and resident already)."""
        if not self._open:
            return None
        ev = self.copy_stream.record()
        self._inflight.append((ev, self._open))
        self._open = []
        return ev

    def settle(self, wait: bool = False) -> int:
        """Make the batches whose copies are done residents (in order; wait: all of them, waiting for the copies);
        their table writes are queued on the current stream. Returns how many blocks became residents."""
        self.seal()
        n = 0
        while self._inflight and (wait or self._inflight[0][0].query()):
            ev, batch = self._inflight.pop(0)
            if wait:
                ev.synchronize()
            for k, s in batch:
                self._inflight_keys.discard(k)
                self._resident(k, s)
            n += len(batch)
        return n

    def in_flight(self) -> int:
        """Blocks admitted whose copies are not yet known done (neither free nor residents)."""
        return len(self._inflight_keys)

    def set_copy_stream(self, stream: "CopyStream | None") -> None:
        """Copies from now on on `stream` (None: the current stream, resident at once); what is in flight on the old
        one is waited for and made resident first."""
        if stream is self.copy_stream:
            return
        self.settle(wait=True)
        if stream is not None:           # the buffer freed with copies pending: its memory waits for them
            stream.keep(self.buf)
        self.copy_stream = stream

    def _resident(self, k: tuple[int, int], s: int) -> None:
        """A block copied into slot s becomes a resident: the maps, the heap, the device table."""
        j, e = k
        self.slot_of[k] = s
        self._rows.setdefault(j, {})[e] = s
        heapq.heappush(self._heap, (self._sc.setdefault(j, {}).setdefault(e, self._w), k))
        self.admissions += 1
        self._placed(k, self.address(s))

    def evict(self, j: int, e: int) -> int:
        """Drop a resident now, its slot back to the free list (a block found bad; the tests' stale-table check);
        returns the slot. Refused while its layer is held."""
        if j in self.held:
            raise ValueError(f"VRAM tier: MoE layer {j} is routed on the device this token, its experts stay")
        self.score_uses()
        s = self._evict((j, e))
        self._heap = [(v, k) for v, k in self._heap if k != (j, e)]
        heapq.heapify(self._heap)
        self.free.append(s)
        return s

    def lend(self, n: int) -> list[int]:
        """Up to n slots lent out (a long prompt's ahead slots, gpu_worker/prefill_experts.py), free ones first, then
        the coldest residents of layers not held this token, evicted; never more than LEND_SHARE of the tier. Their
        rows, ascending (neighbours make runs of copies); `take_back` returns them free. The evictions' table writes
        are queued on the current stream, before anything the borrower queues after this call."""
        self.score_uses()
        n = max(0, min(n, self.lendable()))
        got = self.free[-n:] if n else []
        del self.free[len(self.free) - len(got):]
        if len(got) < n:
            sc, held = self._sc, self.held
            cold = sorted((sc[k[0]][k[1]], k) for k in self.slot_of if k[0] not in held)[:n - len(got)]
            for _, k in cold:
                got.append(self._evict(k))
                self.lent_keys.append(k)
            if cold:
                self._heap = [(v, k) for v, k in self._heap if k in self.slot_of]
                heapq.heapify(self._heap)
            self.lent_evictions += len(cold)
        self.lent += len(got)
        return sorted(got)

    def take_lent_keys(self) -> list[tuple[int, int]]:
        """The residents evicted by lends since the last call that are not residents again or on their way in (the
        borrower may copy them back into the returned slots: `StreamingExperts.restore_lent`); forgotten here."""
        keys, self.lent_keys = self.lent_keys, []
        return [k for k in keys if k not in self.slot_of and k not in self._inflight_keys]

    def lendable(self) -> int:
        """Slots `lend` would give now: LEND_SHARE's part of the tier less what is out."""
        return max(0, self.n_slots // LEND_SHARE - self.lent)

    def take_back(self, slots: list[int]) -> None:
        """Slots `lend` gave, back to the free list (empty: the borrower's blocks are not residents); whatever read or
        wrote them must be done or ordered before the next admission's copy (the borrower's to ensure)."""
        if len(slots) > self.lent or len(set(slots)) != len(slots):
            raise ValueError(f"VRAM tier: {len(slots)} slots given back, {self.lent} lent")
        self.lent -= len(slots)
        self.free.extend(sorted(slots, reverse=True))      # (`free` pops from its end: the lowest row first)

    def _evict(self, k: tuple[int, int]) -> int:
        """Drop a resident (its heap entry is the caller's); returns its slot."""
        s = self.slot_of.pop(k)
        del self._rows[k[0]][k[1]]
        self.evictions += 1
        self._placed(k, 0)
        return s

    def _placed(self, k: tuple[int, int], address: int) -> None:
        """The device table and the per-layer count follow every admission (address) and eviction (0)."""
        if self.table is None:
            return
        self.resident[k[0]] += 1 if address else -1
        self.table[k[0], k[1]] = address      # on CUDA a one-element fill, ordered after the kernels before it

    # ------------------------------------------------------------------ device routing
    def complete(self, j: int) -> bool:
        return self.table is not None and self.resident[j] == self.n_experts

    def hold(self, layers=frozenset()) -> frozenset[int]:
        """Hold `layers` (complete ones) against eviction until the next call; `hold()`: none. Returns the held."""
        held = frozenset(layers)
        bad = [j for j in held if not self.complete(j)]
        if bad:
            raise ValueError(f"VRAM tier: MoE layers {sorted(bad)} are not complete, they cannot be device-routed")
        self.held = held
        return held

    def routable(self) -> frozenset[int]:
        """The complete layers, less those that yielded to an admission since the last call (they run one token
        host-routed, so that the eviction can go ahead)."""
        if self.table is None:
            return frozenset()
        out = frozenset(j for j, n in enumerate(self.resident) if n == self.n_experts and j not in self._yielding)
        self._yielding = set()
        return out

    def fillable(self) -> tuple[int, list[int]] | None:
        """(layer, its missing experts) of the incomplete layer with the fewest missing, if the free slots can take
        all of them; else None. Experts on their way in (`in_flight`) are not missing."""
        if self.table is None or not self.free:
            return None
        coming = [0] * len(self.resident)          # blocks on their way in (a copy stream's batches) count as there
        for j, _ in self._inflight_keys:
            coming[j] += 1
        best, fewest = None, 0
        for j, n in enumerate(self.resident):
            missing = self.n_experts - n - coming[j]
            if 0 < missing <= len(self.free) and (best is None or missing < fewest):
                best, fewest = j, missing
        if best is None:
            return None
        there, inflight = self.slot_of, self._inflight_keys
        return best, [e for e in range(self.n_experts) if (best, e) not in there and (best, e) not in inflight]

    def _coldest(self) -> tuple[int, int]:
        """The resident with the lowest decayed count (at the top of the heap once the stale tops are fixed)."""
        heap, sc = self._heap, self._sc
        while True:
            s, k = heap[0]
            now = sc[k[0]][k[1]]
            if now == s:
                return k
            heapq.heapreplace(heap, (now, k))

    def _tick(self) -> None:
        self.score_uses()                # the uses found before this token, at their token's weight
        self._w *= self._growth
        if self._w > _RESCALE_AT:
            w = self._w
            self._sc = {j: {e: v / w for e, v in row.items() if v / w > 1e-300 or e in self._rows.get(j, _EMPTY)}
                        for j, row in self._sc.items()}
            self._heap = [(self._sc[k[0]][k[1]], k) for k in self.slot_of]
            heapq.heapify(self._heap)
            self._w = 1.0


class CopyStream:
    """The tier's copies on a CUDA stream of their own (`VramTier.set_copy_stream`): ordered after what the current
    stream has queued so far (`after_current`), queued inside `queue()`, a batch's end marked by `record()`'s event."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def after_current(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def keep(self, buf: torch.Tensor) -> None:
        """`buf` (allocated on another stream) is written here: the caching allocator must not hand its memory out
        again, once freed, before this stream's copies into it are done."""
        buf.record_stream(self.stream)

    def queue(self):
        return torch.cuda.stream(self.stream)

    def record(self):
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


# What a prefill is given beside the VRAM tier, when the user names no size (`prefill_reserve_bytes`): the base
# reserve and an eighth of what the dense part leaves of the budget, the extra at most 512 MiB. Measured (H200, session
# 12 calls 3-4, bench/NOTES.md): a 16k prompt took 381-393 ms under 512 MiB, 204-206 under 1 GiB, 177 under 2 GiB
# (none: 181): the first extra 512 MiB buys nearly all of it. What the tier gives up (bench.vram_tier on the 16k
# trace, the original's 26 GB/s bus): 7.9 -> 7.4 GiB of tier (a 16 GB card) 58.0 -> 59.5 ms of bus a token, 3.9 ->
# 3.4 GiB (12 GB) 71.1 -> 73.0. An 8 GB card (6.6 GiB dense) keeps about the base.
PREFILL_SHARE = 8
PREFILL_EXTRA_MAX = 512 << 20
# A long prompt may borrow tier slots for its ahead slots (`VramTier.lend`): at most 1/LEND_SHARE of the tier, so
# decode keeps most of its residents (the lent ones come back free and the tier's admissions refill them)
LEND_SHARE = 2


def prefill_reserve_bytes(vram_budget_bytes: int, used_bytes: int, base_bytes: int) -> int:
    """The device bytes kept beside the VRAM tier for a prefill's activations and the KV caches: `base_bytes` and
    1/PREFILL_SHARE of what the budget leaves past the dense part and the base, at most PREFILL_EXTRA_MAX more."""
    left = max(vram_budget_bytes - used_bytes - base_bytes, 0)
    return base_bytes + min(PREFILL_EXTRA_MAX, left // PREFILL_SHARE)


def vram_tier_slots(vram_budget_bytes: int, used_bytes: int, block_stride: int, reserve_bytes: int) -> int:
    """Slots that fit in what the budget leaves after the dense part and a reserve for activations/KV."""
    left = vram_budget_bytes - used_bytes - reserve_bytes
    return max(left // block_stride, 0)
