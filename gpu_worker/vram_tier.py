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
"""
from __future__ import annotations

import heapq

import torch

# scores grow by a factor per token instead of all of them decaying; rescaled before floats overflow
_RESCALE_AT = 1e150


class VramTier:
    def __init__(self, n_slots: int, block_stride: int, block_bytes: int, device, admit_after: int = 2,
                 half_life_tokens: float = 256.0):
        if admit_after < 1:
            raise ValueError(f"admit_after must be >= 1, got {admit_after}")
        if not half_life_tokens > 0:
            raise ValueError(f"half_life_tokens must be > 0 (math.inf: no decay), got {half_life_tokens}")
        self.device = torch.device(device)
        self.n_slots, self.block_bytes = n_slots, block_bytes
        self.buf = torch.empty((n_slots, block_stride), dtype=torch.uint8, device=self.device)
        # slot addresses by arithmetic: `buf[slot].data_ptr()` is a tensor op, ~2 µs per expert on the route path
        self._base, self._stride = self.buf.data_ptr(), block_stride
        self.slot_of: dict[tuple[int, int], int] = {}
        self.free = list(range(n_slots - 1, -1, -1))
        self.uses: dict[tuple[int, int], int] = {}          # raw use counts: the `admit_after` gate
        self.score: dict[tuple[int, int], float] = {}       # decayed use counts, in units of this token's weight
        self.admit_after = admit_after
        self._growth = 2.0 ** (1.0 / half_life_tokens)      # 1.0 for math.inf: plain counts
        self._w = 1.0                                        # the weight of a use at this token
        # one (score when pushed, key) per resident; a resident's score only grows, so an entry may be stale
        # (too low) but never too high: the top is fixed up lazily in `_coldest`
        self._heap: list[tuple[float, tuple[int, int]]] = []
        self.hits = self.admissions = self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def lookup(self, j: int, experts: list[int]) -> dict[int, int]:
        """{expert: vram slot} of the experts resident on the device (counts their uses)."""
        if j == 0:
            self._tick()
        got = {}
        sc, w = self.score, self._w
        for e in experts:
            s = self.slot_of.get((j, e))
            if s is not None:
                sc[j, e] += w
                got[e] = s
        self.hits += len(got)
        return got

    def block(self, slot: int) -> torch.Tensor:
        return self.buf[slot, :self.block_bytes]

    def address(self, slot: int) -> int:
        return self._base + slot * self._stride

    def want(self, j: int, e: int) -> bool:
        """Count a use from the slab; True if the expert should now be admitted (see the module docstring)."""
        if self.n_slots == 0:
            return False
        k = (j, e)
        n = self.uses.get(k, 0) + 1
        self.uses[k] = n
        before = self.score.get(k, 0.0)
        self.score[k] = before + self._w
        if n < self.admit_after or k in self.slot_of:
            return False
        return bool(self.free) or before > self.score[self._coldest()]

    def admit(self, j: int, e: int, src: torch.Tensor) -> None:
        """Copy a block (a U8 view of a pinned slab slot) into the tier, evicting the coldest resident."""
        k = (j, e)
        if self.free:
            s = self.free.pop()
        else:
            s = self.slot_of.pop(self._coldest())
            heapq.heappop(self._heap)
            self.evictions += 1
        self.buf[s, :self.block_bytes].copy_(src, non_blocking=True)
        self.slot_of[k] = s
        heapq.heappush(self._heap, (self.score.setdefault(k, self._w), k))
        self.admissions += 1

    def _coldest(self) -> tuple[int, int]:
        """The resident with the lowest decayed count (at the top of the heap once the stale tops are fixed)."""
        heap, sc = self._heap, self.score
        while True:
            s, k = heap[0]
            now = sc[k]
            if now == s:
                return k
            heapq.heapreplace(heap, (now, k))

    def _tick(self) -> None:
        self._w *= self._growth
        if self._w > _RESCALE_AT:
            w = self._w
            self.score = {k: v / w for k, v in self.score.items() if v / w > 1e-300 or k in self.slot_of}
            self._heap = [(self.score[k], k) for k in self.slot_of]
            heapq.heapify(self._heap)
            self._w = 1.0


def vram_tier_slots(vram_budget_bytes: int, used_bytes: int, block_stride: int, reserve_bytes: int) -> int:
    """Slots that fit in what the budget leaves after the dense part and a reserve for activations/KV."""
    left = vram_budget_bytes - used_bytes - reserve_bytes
    return max(left // block_stride, 0)
