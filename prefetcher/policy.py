"""Eviction policies: which resident slot to give up when a read needs one.

A policy sees slots enter (insert), get used (touch) and leave (remove), and names a victim among
the slots the caller calls evictable (not pinned, not loading). Pluggable by name: POLICIES.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np


class LRUPolicy:
    """Least recently used first."""
    name = "lru"

    def __init__(self, n_layers: int, n_experts: int):
        self._order: OrderedDict[int, int] = OrderedDict()   # slot -> key, oldest first

    def __len__(self):
        return len(self._order)

    def __contains__(self, slot):
        return slot in self._order

    def insert(self, slot: int, key: int) -> None:
        self._order[slot] = key
        self._order.move_to_end(slot)

    def touch(self, slot: int, key: int) -> None:
        if slot in self._order:
            self._order.move_to_end(slot)

    def remove(self, slot: int) -> None:
        self._order.pop(slot, None)

    def demote(self, slot: int) -> None:
        """To the eviction end: a block a prefill loaded and is done with."""
        if slot in self._order:
            self._order.move_to_end(slot, last=False)

    def choose_victim(self, evictable) -> int | None:
        for slot in self._order:
            if evictable(slot):
                return slot
        return None


class LFUAwareLRUPolicy(LRUPolicy):
    """LRU, but among the `window` least recently used evictable slots, evict the expert used least
    often. Use counts are per expert (kept while it is out of the cache), halved every
    `halve_every` touches so old popularity fades. Routing is concentrated (MISSION: 24 % of experts
    serve 81-84 % of lookups), so a popular expert should outlive a one-off that happened to be recent."""
    name = "lfu"

    def __init__(self, n_layers: int, n_experts: int, window: int = 8, halve_every: int = 100_000):
        super().__init__(n_layers, n_experts)
        self.uses = np.zeros(n_layers * n_experts, dtype=np.float32)
        self.window, self.halve_every, self._touches = window, halve_every, 0

    def insert(self, slot: int, key: int) -> None:
        super().insert(slot, key)

    def touch(self, slot: int, key: int) -> None:
        super().touch(slot, key)
        self.uses[key] += 1.0
        self._touches += 1
        if self._touches >= self.halve_every:
            self.uses *= 0.5
            self._touches = 0

    def choose_victim(self, evictable) -> int | None:
        best, best_uses, seen = None, None, 0
        for slot, key in self._order.items():
            if not evictable(slot):
                continue
            u = self.uses[key]
            if best is None or u < best_uses:
                best, best_uses = slot, u
            seen += 1
            if seen >= self.window:
                break
        return best


class DecayedFrequencyPolicy:
    """LRFU: each use (an insert or a touch) adds 1 to the expert's count, and counts halve every
    `half_life` uses of the whole cache; the victim is the evictable slot with the smallest count.
    Between LRU (short half-life) and LFU (long). A count is kept as log2(count) + clock / half_life, which
    does not change while the clock runs (every count decays alike), so the order is a heap of fixed keys.
    Counts are per expert and outlive its eviction, like LFUAwareLRUPolicy's."""
    name = "lrfu"

    def __init__(self, n_layers: int, n_experts: int, half_life: float = 4096.0):
        self.half_life = float(half_life)
        self.level = np.full(n_layers * n_experts, -np.inf)   # log2(count) + clock / half_life, per expert
        self._clock = 0
        self._key: dict[int, int] = {}                         # slot -> expert key
        self._heap: list[tuple[float, int, int]] = []          # (level, slot, key); stale entries skipped
        self._demoted: set[int] = set()

    def __len__(self):
        return len(self._key)

    def __contains__(self, slot):
        return slot in self._key

    def _use(self, slot: int, key: int) -> None:
        now = self._clock / self.half_life
        lv = self.level[key]
        self.level[key] = now + np.log2(1.0 + (np.exp2(lv - now) if lv > -np.inf else 0.0))
        self._clock += 1
        self._key[slot] = key
        self._demoted.discard(slot)
        heapq.heappush(self._heap, (float(self.level[key]), slot, key))

    def insert(self, slot: int, key: int) -> None:
        self._use(slot, key)

    def touch(self, slot: int, key: int) -> None:
        if slot in self._key:
            self._use(slot, key)

    def remove(self, slot: int) -> None:
        self._key.pop(slot, None)
        self._demoted.discard(slot)

    def demote(self, slot: int) -> None:
        """To the eviction end until its next use: a block a prefill loaded and is done with."""
        if slot in self._key:
            self._demoted.add(slot)
            heapq.heappush(self._heap, (-np.inf, slot, self._key[slot]))

    def choose_victim(self, evictable) -> int | None:
        skipped, victim = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            lv, slot, key = entry
            if self._key.get(slot) != key or not (lv == self.level[key] or (lv == -np.inf and slot in self._demoted)):
                continue                                        # stale: the slot moved on or was used since
            if evictable(slot):
                victim = slot
                skipped.append(entry)                           # still resident until the caller removes it
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._key) + 64:          # drop stale entries now and then
            self._heap = [(float(self.level[k]), s, k) for s, k in self._key.items()]
            heapq.heapify(self._heap)
        return victim


class SegmentedLRUPolicy:
    """Segmented LRU with a ghost list, 2Q-like: a slot enters on probation, a touch while resident moves it to
    the protected segment (at most `protected` of the cache's slots, taken as the most ever resident; its oldest
    fall back to probation), victims come from probation first. An expert evicted within the last `ghost` × resident evictions re-enters protected
    (it was used again soon after it left: 2Q's A1out). Scan resistance for one-off reads, e.g. a wrong guess
    that is read ahead and never used sits on probation, not at the head of an LRU."""
    name = "slru"

    def __init__(self, n_layers: int, n_experts: int, protected: float = 0.5, ghost: float = 1.0):
        if not 0.0 < protected < 1.0:
            raise ValueError(f"slru: protected share {protected} is not in (0, 1)")
        self.protected_share, self.ghost_share = float(protected), float(ghost)
        self._prob: OrderedDict[int, int] = OrderedDict()     # slot -> key, oldest first
        self._prot: OrderedDict[int, int] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()   # recently evicted expert keys, oldest first
        self.c = 1

    def __len__(self):
        return len(self._prob) + len(self._prot)

    def __contains__(self, slot):
        return slot in self._prob or slot in self._prot

    def _rebalance(self) -> None:
        limit = max(1, int(self.protected_share * self.c))
        while len(self._prot) > limit:
            s, k = self._prot.popitem(last=False)
            self._prob[s] = k

    def insert(self, slot: int, key: int) -> None:
        self._prob.pop(slot, None)
        self._prot.pop(slot, None)
        if key in self._ghost:
            del self._ghost[key]
            self._prot[slot] = key
            self._rebalance()
        else:
            self._prob[slot] = key
        self.c = max(self.c, len(self))

    def touch(self, slot: int, key: int) -> None:
        if slot in self._prob:
            del self._prob[slot]
            self._prot[slot] = key
            self._rebalance()
        elif slot in self._prot:
            self._prot.move_to_end(slot)

    def remove(self, slot: int) -> None:
        key = self._prob.pop(slot, None)
        if key is None:
            key = self._prot.pop(slot, None)
        if key is not None and self.ghost_share > 0:
            self._ghost[key] = None
            self._ghost.move_to_end(key)
            while len(self._ghost) > self.ghost_share * self.c:
                self._ghost.popitem(last=False)

    def demote(self, slot: int) -> None:
        """To the eviction end: a block a prefill loaded and is done with."""
        key = self._prot.pop(slot, None)
        if key is not None:
            self._prob[slot] = key
        if slot in self._prob:
            self._prob.move_to_end(slot, last=False)

    def choose_victim(self, evictable) -> int | None:
        for seg in (self._prob, self._prot):
            for slot in seg:
                if evictable(slot):
                    return slot
        return None


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha 2003) over slots: T1 holds experts used once since they
    entered, T2 those used again; ghost lists B1 / B2 remember keys evicted from each, and a miss that finds its
    key in B1 (B2) grows (shrinks) T1's target share p. The cache's size c is not given to a policy: it is taken
    as the most slots ever resident (the shared cache fills and stays full)."""
    name = "arc"

    def __init__(self, n_layers: int, n_experts: int):
        self._t1: OrderedDict[int, int] = OrderedDict()       # slot -> key, oldest first
        self._t2: OrderedDict[int, int] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()      # ghost keys, oldest first
        self._b2: OrderedDict[int, None] = OrderedDict()
        self.p, self.c = 0.0, 1

    def __len__(self):
        return len(self._t1) + len(self._t2)

    def __contains__(self, slot):
        return slot in self._t1 or slot in self._t2

    def insert(self, slot: int, key: int) -> None:
        self._t1.pop(slot, None)
        self._t2.pop(slot, None)
        if key in self._b1:
            self.p = min(float(self.c), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[slot] = key
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[slot] = key
        else:
            self._t1[slot] = key
        self.c = max(self.c, len(self))

    def touch(self, slot: int, key: int) -> None:
        if slot in self._t1:
            del self._t1[slot]
            self._t2[slot] = key
        elif slot in self._t2:
            self._t2.move_to_end(slot)

    def remove(self, slot: int) -> None:
        if slot in self._t1:
            self._b1[self._t1.pop(slot)] = None
        elif slot in self._t2:
            self._b2[self._t2.pop(slot)] = None
        else:
            return
        while len(self._t1) + len(self._b1) > self.c and self._b1:
            self._b1.popitem(last=False)
        while len(self) + len(self._b1) + len(self._b2) > 2 * self.c and self._b2:
            self._b2.popitem(last=False)

    def demote(self, slot: int) -> None:
        """To the eviction end: a block a prefill loaded and is done with."""
        key = self._t2.pop(slot, None)
        if key is not None:
            self._t1[slot] = key
        if slot in self._t1:
            self._t1.move_to_end(slot, last=False)

    def choose_victim(self, evictable) -> int | None:
        first = (self._t1, self._t2) if self._t1 and len(self._t1) > self.p else (self._t2, self._t1)
        for seg in first:
            for slot in seg:
                if evictable(slot):
                    return slot
        return None


POLICIES = {p.name: p for p in (LRUPolicy, LFUAwareLRUPolicy, DecayedFrequencyPolicy, SegmentedLRUPolicy,
                                ARCPolicy)}


def make_policy(name: str, n_layers: int, n_experts: int):
    try:
        return POLICIES[name](n_layers, n_experts)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; known: {sorted(POLICIES)}") from None
