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


class ReusePolicy:
    """A victim ranking by the reuse probability learned online from the decode's own messages, which the classical
    policies do not see: each expert's next use is at its layer's next turn (the next token), so the policy counts,
    per (layer, turns since the expert's last use, its decayed use count, whether the guess named it for that turn),
    how often an expert in that cell was used at its layer's turn, and evicts the resident in the least likely cell
    (ties: the least recently inserted or touched, so with nothing learned yet it is LRU). One ranking over every
    layer gives skewed layers more of the cache without a quota. `observe(layer, actual, guess_layer, guess)` is the
    layer message (the prefetcher and bench/policy_sim.py call it when a policy has it, before the lookups);
    `admit(key, victim)` refuses a read ahead whose guessed cell is less likely used than the victim's (a guess no
    better than chance, e.g. the last layer's for the next token's first, is not read).
    Measured on the instrument's 16k trace: bench/NOTES.md, session 13 h-policy."""
    name = "reuse"
    AGE_EDGES = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])     # bucket i: age <= edge i; the last: older/never
    FREQ_EDGES = np.array([0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0])

    def __init__(self, n_layers: int, n_experts: int, half_life: float = 64.0, admission: bool = True,
                 features: str = "layer,age,freq,guess"):
        self.L, self.E = int(n_layers), int(n_experts)
        self.features = set(features.split(","))               # fewer: the ablations in bench/NOTES.md
        K = self.L * self.E
        self.decay = 0.5 ** (1.0 / float(half_life))           # per turn of the expert's layer
        self.admission = bool(admission)
        self.turn = np.zeros(self.L, dtype=np.int64)            # per layer: the index of its next turn
        self.last_use = np.full(K, -(1 << 40), dtype=np.int64)   # turn of the last use; never: far past
        self.guessed_for = np.full(K, -1, dtype=np.int64)       # the turn a guess named the expert for
        self.freq = np.zeros(K)                                 # uses, halved every half_life turns of its layer
        self._na, self._nf = len(self.AGE_EDGES) + 1, len(self.FREQ_EDGES) + 1
        n_cells = self.L * self._na * self._nf * 2
        self.used_in_cell = np.zeros(n_cells)
        self.seen_in_cell = np.zeros(n_cells)
        self._key_of_slot = np.full(64, -1, dtype=np.int64)
        self._tick_of_slot = np.zeros(64, dtype=np.int64)
        self._demoted = np.zeros(64, dtype=bool)
        self._tick, self._n = 0, 0
        # The ranking kept between evictions (choose_victim pops it instead of ranking every resident): the
        # probability of every key (it changes only in observe, and there only for the message's layer and the
        # guessed one while cells are per layer), one heap per layer of (p, tick, version, slot) entries — a touch,
        # insert or demote pushes a new entry and bumps the slot's version, so older entries are skipped when they
        # come up — and a heap of the layers' heads. The victim is the same as _ranked's first evictable slot.
        self._p_key = self.reuse_probability(np.arange(K))
        self._ver: list[int] = [0] * 64                          # per slot; an entry is live iff its version matches
        self._layer_slots: list[set[int]] = [set() for _ in range(self.L)]
        self._heaps: list[list[tuple]] = [[] for _ in range(self.L)]
        self._gheap: list[tuple] = []                            # (p, tick, version, slot, layer): the layers' heads
        self._slot_of_key: dict[int, int] = {}
        self._dirty: set[int] = set()    # layers whose probabilities a message moved, re-ranked when next needed

    def __len__(self):
        return self._n

    def __contains__(self, slot):
        return 0 <= slot < len(self._key_of_slot) and self._key_of_slot[slot] >= 0

    # ---- what the decode says --------------------------------------------------------------
    def _cells(self, layer, age, freq, guessed):
        fs = self.features
        a = np.searchsorted(self.AGE_EDGES, age, side="left") if "age" in fs else 0
        f = np.searchsorted(self.FREQ_EDGES, freq, side="right") if "freq" in fs else 0
        j = layer if "layer" in fs else 0 * layer
        return ((j * self._na + a) * self._nf + f) * 2 + (guessed if "guess" in fs else 0 * guessed)

    def observe(self, layer: int, actual, guess_layer=None, guess=()) -> None:
        j, E = int(layer), self.E
        sl = slice(j * E, (j + 1) * E)
        t = self.turn[j]
        cells = self._cells(j, t - self.last_use[sl], self.freq[sl], self.guessed_for[sl] == t)
        used = np.zeros(E)
        act = np.asarray(list(actual), dtype=np.int64)
        used[act] = 1.0
        if "layer" in self.features:                           # the layer's cells only: a block of the counts
            n = self._na * self._nf * 2
            lo = j * n
            self.seen_in_cell[lo:lo + n] += np.bincount(cells - lo, minlength=n)
            self.used_in_cell[lo:lo + n] += np.bincount(cells - lo, weights=used, minlength=n)
        else:
            n = len(self.seen_in_cell)
            self.seen_in_cell += np.bincount(cells, minlength=n)
            self.used_in_cell += np.bincount(cells, weights=used, minlength=n)
        self.freq[sl] *= self.decay
        self.freq[j * E + act] += 1.0
        self.last_use[j * E + act] = t
        self.turn[j] = t + 1
        changed, gkeys = {j}, None
        if guess_layer is not None and len(guess):
            g = int(guess_layer)
            gkeys = g * E + np.asarray(list(guess), dtype=np.int64)
            self.guessed_for[gkeys] = self.turn[g]
            if g == j:
                gkeys = None
            else:
                changed.add(g)
        if "layer" not in self.features:                       # shared cells: every key's probability moved
            changed = range(self.L)
        elif gkeys is not None:                                 # another layer: only the guessed keys' flags moved
            changed = (j,)
            p = self.reuse_probability(gkeys)
            self._p_key[gkeys] = p
            slot_of = self._slot_of_key
            for k, pk in zip(gkeys.tolist(), p.tolist()):
                s = slot_of.get(k)
                if s is not None and not self._demoted[s]:
                    self._push(s, k, pk)
        self._dirty.update(changed)      # re-ranked at the next eviction or admission (`_settle`), not per message:
        # a cache that never evicts (the RAM regime) pays only the counts above

    def _settle(self) -> None:
        """The layers the messages since the last eviction moved, re-ranked from the state as it is now (what a full
        ranking would see)."""
        for j in self._dirty:
            self._refresh(j)
        self._dirty.clear()

    def _refresh(self, j: int) -> None:
        """Recompute layer j's key probabilities and re-rank its residents (a sorted list is a heap)."""
        E = self.E
        self._p_key[j * E:(j + 1) * E] = self.reuse_probability(np.arange(j * E, (j + 1) * E))
        self._rebuild(j)

    def _rebuild(self, j: int) -> None:
        """Layer j's heap from its residents' current probabilities and ticks (drops its stale entries)."""
        members = self._layer_slots[j]
        if not members:
            self._heaps[j] = []
            return
        slots = np.fromiter(members, dtype=np.int64, count=len(members))
        p = self._p_key[self._key_of_slot[slots]]
        p[self._demoted[slots]] = -1.0
        ticks = self._tick_of_slot[slots]
        order = np.lexsort((ticks, p))
        slots, p, ticks = slots[order].tolist(), p[order].tolist(), ticks[order].tolist()
        ver = self._ver
        h = self._heaps[j] = list(zip(p, ticks, [ver[s] for s in slots], slots))
        heapq.heappush(self._gheap, h[0] + (j,))

    def reuse_probability(self, keys) -> np.ndarray:
        """The learned chance that each expert key is used at its layer's next turn (a weak prior: chance)."""
        keys = np.asarray(keys, dtype=np.int64)
        j = keys // self.E
        t = self.turn[j]
        cells = self._cells(j, t - self.last_use[keys], self.freq[keys], self.guessed_for[keys] == t)
        prior = 1.0 / max(self.E, 1)
        return (self.used_in_cell[cells] + 8.0 * prior) / (self.seen_in_cell[cells] + 8.0)

    # ---- the slots -------------------------------------------------------------------------
    def _grow(self, slot: int) -> None:
        if slot >= len(self._key_of_slot):
            n = max(slot + 1, 2 * len(self._key_of_slot))
            self._key_of_slot = np.concatenate([self._key_of_slot, np.full(n - len(self._key_of_slot), -1)])
            self._tick_of_slot = np.concatenate([self._tick_of_slot, np.zeros(n - len(self._tick_of_slot), np.int64)])
            self._demoted = np.concatenate([self._demoted, np.zeros(n - len(self._demoted), bool)])
            self._ver.extend([0] * (n - len(self._ver)))

    def _push(self, slot: int, key: int, p: float) -> None:
        """A new live entry for the slot (its older ones go stale)."""
        self._ver[slot] += 1
        j = key // self.E
        e = (p, int(self._tick_of_slot[slot]), self._ver[slot], slot)
        h = self._heaps[j]
        heapq.heappush(h, e)
        if h[0] is e:
            heapq.heappush(self._gheap, e + (j,))
        if len(h) > 4 * len(self._layer_slots[j]) + 64:        # touches with no message between: compact
            self._rebuild(j)

    def insert(self, slot: int, key: int) -> None:
        self._grow(slot)
        old = int(self._key_of_slot[slot])
        if old < 0:
            self._n += 1
        else:
            self._slot_of_key.pop(old, None)
            if old // self.E != key // self.E:
                self._layer_slots[old // self.E].discard(slot)
        self._key_of_slot[slot] = key
        self._slot_of_key[key] = slot
        self._layer_slots[key // self.E].add(slot)
        self.touch(slot, key)

    def touch(self, slot: int, key: int) -> None:
        if slot in self:
            self._tick += 1
            self._tick_of_slot[slot] = self._tick
            self._demoted[slot] = False
            k = int(self._key_of_slot[slot])
            self._push(slot, k, float(self._p_key[k]))

    def remove(self, slot: int) -> None:
        if slot in self:
            k = int(self._key_of_slot[slot])
            self._layer_slots[k // self.E].discard(slot)
            if self._slot_of_key.get(k) == slot:
                del self._slot_of_key[k]
            self._key_of_slot[slot] = -1
            self._demoted[slot] = False
            self._ver[slot] += 1
            self._n -= 1

    def demote(self, slot: int) -> None:
        """To the eviction end until its next use: a block a prefill loaded and is done with."""
        if slot in self:
            self._demoted[slot] = True
            self._push(slot, int(self._key_of_slot[slot]), -1.0)

    def _ranked(self):
        """Every resident, victims first: the full ranking (the reference the kept heaps reproduce; tests)."""
        slots = np.flatnonzero(self._key_of_slot >= 0)
        p = self.reuse_probability(self._key_of_slot[slots])
        p[self._demoted[slots]] = -1.0
        order = np.lexsort((self._tick_of_slot[slots], p))
        return slots[order], p[order]

    def choose_victim_full(self, evictable) -> int | None:
        """choose_victim by ranking every resident (O(slots) numpy per call; the reference)."""
        slots, _ = self._ranked()
        for s in slots:
            if evictable(int(s)):
                return int(s)
        return None

    def choose_victim(self, evictable) -> int | None:
        """The least likely used evictable resident, ties to the least recent: the heads of the per-layer heaps
        merged through the heap of heads, stale entries dropped, unevictable ones set aside and put back."""
        if self._dirty:
            self._settle()
        gh, heaps, ver = self._gheap, self._heaps, self._ver
        pop, push = heapq.heappop, heapq.heappush
        skipped, victim = [], None
        while gh:
            top = gh[0]
            j = top[4]
            h = heaps[j]
            if not h or h[0] != top[:4]:
                pop(gh)                                         # not that layer's head any more
                continue
            e = h[0]
            s = e[3]
            if e[2] == ver[s] and evictable(s):
                victim = s
                break
            pop(gh)
            pop(h)
            if e[2] == ver[s]:
                skipped.append((j, e))                          # live but not evictable now: put back below
            if h:
                push(gh, h[0] + (j,))
        for j, e in skipped:
            h = heaps[j]
            push(h, e)
            if h[0] is e:
                push(gh, e + (j,))
        if len(gh) > 4 * self.L + 256:                         # drop the heads that went stale
            self._gheap = [h[0] + (j,) for j, h in enumerate(heaps) if h]
            heapq.heapify(self._gheap)
        return victim

    def admit(self, key: int, victim: int) -> bool:
        """Read the guessed expert `key` ahead into the victim's slot only if it is at least as likely used."""
        if not self.admission or victim not in self:
            return True
        if self._dirty:
            self._settle()
        return bool(self._p_key[key] >= self._p_key[int(self._key_of_slot[victim])])


POLICIES = {p.name: p for p in (LRUPolicy, LFUAwareLRUPolicy, DecayedFrequencyPolicy, SegmentedLRUPolicy,
                                ARCPolicy, ReusePolicy)}


def make_policy(name: str, n_layers: int, n_experts: int):
    try:
        return POLICIES[name](n_layers, n_experts)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; known: {sorted(POLICIES)}") from None
