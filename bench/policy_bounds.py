"""Offline references for the cache policies: Belady's MIN (the demand bound), MIN's eviction with the guess
prefetch, and the in-sample fitted recency/frequency ranking (an optimistic bound for that family)."""
from __future__ import annotations

import bisect
import heapq

import numpy as np

from bench.policy_trace import Result, Trace, token_of_steps


def belady(trace: Trace, capacity: int, next_use=None) -> Result:
    """Belady's MIN: on a miss with a full cache, evict the resident expert used again farthest in the future
    (or never). Demand only; optimal in misses for every trace and capacity. `next_use` replaces the next-use
    table (the tests' deliberately wrong optimum)."""
    keys = [trace.key(j, e) for j, ex, _ in trace.steps for e in ex]
    n = len(keys)
    if next_use is None:
        next_use = next_use_table(keys)
    r = Result("belady", False, capacity, tokens=trace.tokens)
    resident: dict[int, int] = {}           # key -> its next use (position)
    heap: list[tuple[int, int]] = []        # (-next use, key); stale entries skipped
    for p, k in enumerate(keys):
        r.accesses += 1
        if k in resident:
            r.hits += 1
        else:
            r.demand_reads += 1
            if len(resident) >= capacity:
                while True:
                    nu, victim = heapq.heappop(heap)
                    if resident.get(victim) == -nu:
                        break
                del resident[victim]
        resident[k] = int(next_use[p]) if next_use[p] < n else n + k      # never again: farthest (ties apart)
        heapq.heappush(heap, (-resident[k], k))
    return r


def next_use_table(keys) -> np.ndarray:
    """next_use[p] = the next position of keys[p], or len(keys) if it is not used again."""
    n = len(keys)
    out = np.full(n, n, dtype=np.int64)
    last: dict[int, int] = {}
    for p in range(n - 1, -1, -1):
        out[p] = last.get(keys[p], n)
        last[keys[p]] = p
    return out


def belady_prefetch(trace: Trace, capacity: int, nearest: bool = False) -> Result:
    """Belady's eviction with the same guess prefetch as `simulate(..., prefetch=True)`: a reference for the
    prefetching policies, not a bound (the reads ahead are fixed by the guess, and a read ahead may push out
    an expert that MIN would keep). Evicts the unpinned resident used again farthest in the future (`nearest`:
    the soonest, the tests' deliberately wrong reference)."""
    keys = [trace.key(j, e) for j, ex, _ in trace.steps for e in ex]
    n = len(keys)
    where: dict[int, list[int]] = {}
    for p, k in enumerate(keys):
        where.setdefault(k, []).append(p)

    def next_after(k: int, p: int) -> int:      # first use of k at position >= p, or farther than any
        ps = where.get(k, ())
        i = bisect.bisect_left(ps, p)
        return ps[i] if i < len(ps) else n + k
    r = Result("belady", True, capacity, tokens=trace.tokens)
    resident: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    unused: set[int] = set()

    def make_room(pinned, p) -> bool:
        if len(resident) < capacity:
            return True
        skipped, victim = [], None
        while heap:
            nu, k = heapq.heappop(heap)
            if resident.get(k) != sign * nu:
                continue
            if k in pinned:
                skipped.append((nu, k))
                continue
            victim = k
            break
        for e in skipped:
            heapq.heappush(heap, e)
        if victim is None:
            return False
        del resident[victim]
        if victim in unused:
            unused.discard(victim)
            r.prefetch_wasted += 1
        return True

    sign = 1 if nearest else -1

    def place(k: int, p: int) -> None:
        resident[k] = next_after(k, p)
        heapq.heappush(heap, (sign * resident[k], k))
    p = 0
    for j, ex, guess in trace.steps:
        step = [trace.key(j, e) for e in ex]
        pinned = set(step)
        for k in step:
            r.accesses += 1
            if k in resident:
                r.hits += 1
                if k in unused:
                    unused.discard(k)
                    r.prefetch_used += 1
            else:
                r.demand_reads += 1
                make_room(pinned, p)
            p += 1
            place(k, p)
        nj = (j + 1) % trace.n_layers
        for e in guess:
            k = trace.key(nj, e)
            if k not in resident and make_room(pinned, p):
                pinned.add(k)
                place(k, p)
                unused.add(k)
                r.prefetch_reads += 1
    r.prefetch_wasted += len(unused)
    return r


MAX_AGE, MAX_USES = 48, 24


def fitted_table(trace: Trace, max_age: int = MAX_AGE, max_uses: int = MAX_USES) -> np.ndarray:
    """prob[a, c]: how often an expert was used at its layer's turn in a token, given a tokens since its last use
    and c uses before (both capped), counted over the whole trace."""
    L, E = trace.n_layers, trace.n_experts
    tok = token_of_steps(trace)
    T = tok[-1] + 1
    used = np.zeros((T, L * E), dtype=bool)
    for (j, ex, _), t in zip(trace.steps, tok):
        used[t, [j * E + e for e in ex]] = True
    num = np.zeros((max_age + 1, max_uses + 1))
    den = np.zeros_like(num)
    for k in range(L * E):
        ts = np.flatnonzero(used[:, k])
        if len(ts) == 0:
            continue
        t = np.arange(ts[0] + 1, T)
        n_before = np.searchsorted(ts, t, side="left")       # uses before token t
        age = np.minimum(t - ts[n_before - 1], max_age)
        c = np.minimum(n_before, max_uses)
        np.add.at(den, (age, c), 1)
        np.add.at(num, (age, c), used[t, k])
    return (num + 0.5) / (den + 8.0)      # a weak prior keeps unseen cells unremarkable


def fitted_ranking(trace: Trace, capacity: int, prob: np.ndarray | None = None) -> Result:
    """An optimistic bound for policies that rank residents by recency and frequency: the victim is the expert
    least likely to be used at its layer's next turn given (tokens since its last use at that turn, its uses
    so far, kept across evictions), with that probability table (`fitted_table`) counted on this same trace:
    in-sample, so no online policy of this family knows it. Ties go to the least recent. Demand only. `prob`
    replaces the table (the tests' deliberately wrong ranking)."""
    L, E = trace.n_layers, trace.n_experts
    prob = fitted_table(trace) if prob is None else prob
    max_age, max_uses = prob.shape[0] - 1, prob.shape[1] - 1
    tok = token_of_steps(trace)
    r = Result("fitted", False, capacity, tokens=trace.tokens)
    last = np.full(L * E, -1, dtype=np.int64)
    uses = np.zeros(L * E, dtype=np.int64)
    resident: set[int] = set()
    for (j, ex, _), t in zip(trace.steps, tok):
        step = [j * E + e for e in ex]
        for k in step:
            r.accesses += 1
            if k in resident:
                r.hits += 1
            else:
                r.demand_reads += 1
                if len(resident) >= capacity:
                    cand = np.array([q for q in resident if q not in step])
                    nxt = np.where(cand // E > j, t, t + 1)
                    score = prob[np.minimum(nxt - last[cand], max_age), np.minimum(uses[cand], max_uses)]
                    resident.discard(int(cand[np.lexsort((last[cand], score))[0]]))
                resident.add(k)
            last[k], uses[k] = t, uses[k] + 1
    return r
