"""Cache policies replayed on recorded routing, beside Belady's optimal policy (the offline bound).

    python -m bench.policy_sim TRACE.msgpack [TRACE ...] --n-experts E [--fractions 0.05,0.1,...]
        [--json OUT.json] [--plot OUT.png]
    python -m bench.policy_sim --synth-trace OUT.msgpack --model CKPT --store STORE [--prompts N --decode T]

A trace is what `python -m tools.logits --store STORE --record-routing FILE` writes: one msgpack record per
MoE layer per decoded token, (moe_index, token, experts chosen, guess for the next MoE layer, hits). Each
record is replayed as the prefetcher sees the message: the chosen experts are looked up (a resident one is a
hit and is touched, a missing one is a demand read), then the guess is applied (`prefetch`: a resident guessed
expert is touched, a missing one is read ahead — the current prefetcher's behaviour). Cache sizes are a
fraction of all n_moe × E experts; the experts of the record being served are pinned (never the victim).

Policies: the prefetcher's own classes (`prefetcher/policy.py`: lru, lfu, lrfu, slru, arc), each demand-only and
with the guess prefetch, and Belady's MIN (evict the expert whose next use is farthest; demand only): no demand
policy misses less, so it bounds every demand policy's hit rate. Prefetching reads beyond the demand misses (its
wasted reads are counted), so a prefetching policy may pass the demand bound in hit rate while reading more.
Two references beside them (`--no-references` skips them): `belady+prefetch`, MIN's eviction with the same reads
ahead (what eviction could add to the guess; not a bound), and `fitted`, the ranking by (tokens since the last
use, uses so far) with the reuse probabilities counted on the trace itself — an in-sample, optimistic bound for
recency/frequency policies: what no such policy can beat by much. `--rotate U:C` replays the trace as U
conversations served C tokens at a time in turn; `--host-cost F` times each policy's bookkeeping per lookup.

Assumptions: every prefetch lands before the next layer needs it (an upper bound on what prefetching buys
and on the reads it wastes); a guessed expert not used by the time it is evicted, or by the end, is wasted.
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from prefetcher.policy import POLICIES, make_policy

FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)
DEFAULT_POLICIES = ("lru", "lfu", "lrfu", "slru", "arc")


@dataclass
class Trace:
    """Decode routing: steps[i] = (moe layer, experts chosen, guess for the next MoE layer)."""
    steps: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    n_layers: int
    n_experts: int
    tokens: int

    def key(self, layer: int, e: int) -> int:
        return layer * self.n_experts + e


def read_trace(paths, n_experts: int | None = None) -> Trace:
    """One or more `--record-routing` files, concatenated in order (a conversation's turns, rotating prompts)."""
    import msgpack
    steps, tokens, n_layers, top = [], 0, 0, 0
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        last_token = None
        with open(path, "rb") as f:
            for rec in msgpack.Unpacker(f):
                if len(rec) != 5:
                    raise ValueError(f"{path}: record {rec!r} is not (moe_index, token, experts, guess, hits)")
                j, tok, ex, guess, _ = rec
                steps.append((int(j), tuple(int(e) for e in ex), tuple(int(e) for e in guess)))
                if tok != last_token:
                    tokens, last_token = tokens + 1, tok
                n_layers = max(n_layers, int(j) + 1)
                top = max([top, *ex, *guess])
    if not steps:
        raise ValueError(f"{paths}: no routing records")
    if n_experts is None:
        n_experts = top + 1
    elif top >= n_experts:
        raise ValueError(f"{paths}: expert {top} in the trace, but --n-experts is {n_experts}")
    return Trace(steps, n_layers, n_experts, tokens)


def synthetic_trace(n_layers: int, n_experts: int, top_k: int, tokens: int, skew: float, seed: int,
                    guess_accuracy: float = 0.7) -> Trace:
    """Seeded random routing with Zipf-like popularity per layer and a drifting hot set; guesses are the next
    layer's actual choice with each expert replaced at random with probability 1 - guess_accuracy."""
    rng = np.random.default_rng(seed)
    base = rng.random((n_layers, n_experts)) ** (1.0 / max(skew, 1e-3))
    steps = []
    choice = [None] * n_layers
    for t in range(tokens):
        for j in range(n_layers):
            w = base[j] * np.exp(0.3 * rng.standard_normal(n_experts))
            choice[j] = tuple(int(e) for e in rng.choice(n_experts, top_k, replace=False, p=w / w.sum()))
        for j in range(n_layers):
            nxt = choice[(j + 1) % n_layers]
            guess = tuple(e if rng.random() < guess_accuracy else int(rng.integers(n_experts)) for e in nxt)
            steps.append((j, choice[j], tuple(dict.fromkeys(guess))))
        base[:, rng.integers(n_experts)] *= 1.5          # popularity drifts
    return Trace(steps, n_layers, n_experts, tokens)


@dataclass
class Result:
    policy: str
    prefetch: bool
    capacity: int
    accesses: int = 0
    hits: int = 0
    demand_reads: int = 0
    prefetch_reads: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.accesses, 1)

    @property
    def reads_per_token(self) -> float:
        return (self.demand_reads + self.prefetch_reads) / max(self.tokens, 1)

    def row(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "reads_per_token": self.reads_per_token}


def simulate(trace: Trace, capacity: int, policy: str, prefetch: bool = False, **policy_kw) -> Result:
    """Replay the trace through one of the prefetcher's policies (slot = expert key, as one expert has at most
    one slot)."""
    top_k = max(len(ex) for _, ex, _ in trace.steps)
    if capacity < top_k:
        raise ValueError(f"a cache of {capacity} experts cannot hold one layer's {top_k}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {sorted(POLICIES)} and belady")
    pol = POLICIES[policy](trace.n_layers, trace.n_experts, **policy_kw) if policy_kw else \
        make_policy(policy, trace.n_layers, trace.n_experts)
    r = Result(policy, prefetch, capacity, tokens=trace.tokens)
    resident: set[int] = set()
    unused_prefetch: set[int] = set()
    pinned: set[int] = set()

    def make_room():
        if len(resident) < capacity:
            return True
        victim = pol.choose_victim(lambda s: s not in pinned)
        if victim is None:
            return False
        pol.remove(victim)
        resident.discard(victim)
        if victim in unused_prefetch:
            unused_prefetch.discard(victim)
            r.prefetch_wasted += 1
        return True

    for j, ex, guess in trace.steps:
        step = [trace.key(j, e) for e in ex]
        pinned = set(step)
        for k in step:
            r.accesses += 1
            if k in resident:
                r.hits += 1
                pol.touch(k, k)
                if k in unused_prefetch:
                    unused_prefetch.discard(k)
                    r.prefetch_used += 1
            else:
                r.demand_reads += 1
                make_room()
                pol.insert(k, k)
                resident.add(k)
        if prefetch:
            nj = (j + 1) % trace.n_layers
            for e in guess:
                k = trace.key(nj, e)
                if k in resident:
                    pol.touch(k, k)
                elif make_room():
                    pinned.add(k)          # the reads in flight are not victims of each other
                    pol.insert(k, k)
                    resident.add(k)
                    unused_prefetch.add(k)
                    r.prefetch_reads += 1
    r.prefetch_wasted += len(unused_prefetch)
    return r


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


def token_of_steps(trace: Trace) -> list[int]:
    """The decode token of each step: a new token starts where the MoE layer index does not grow."""
    out, tok, prev = [], -1, None
    for j, _, _ in trace.steps:
        if prev is None or j <= prev:
            tok += 1
        prev = j
        out.append(tok)
    return out


def belady_prefetch(trace: Trace, capacity: int, nearest: bool = False) -> Result:
    """Belady's eviction with the same guess prefetch as `simulate(..., prefetch=True)`: a reference for the
    prefetching policies, not a bound (the reads ahead are fixed by the guess, and a read ahead may push out
    an expert that MIN would keep). Evicts the unpinned resident used again farthest in the future (`nearest`:
    the soonest, the tests' deliberately wrong reference)."""
    import bisect
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


def rotate(trace: Trace, users: int, chunk: int) -> Trace:
    """Several conversations served in turn: the trace's tokens cut into `users` consecutive parts (one a
    user), then `chunk` tokens of each part in rotation — less locality than one conversation at a time."""
    tok = token_of_steps(trace)
    per_token: list[list] = [[] for _ in range(tok[-1] + 1)]
    for st, t in zip(trace.steps, tok):
        per_token[t].append(st)
    T = len(per_token)
    if users < 1 or chunk < 1 or users > T:
        raise ValueError(f"rotate: {users} users x {chunk} tokens do not fit a trace of {T} tokens")
    parts = [per_token[u * T // users:(u + 1) * T // users] for u in range(users)]
    steps = []
    for c0 in range(0, max(len(p) for p in parts), chunk):
        for p in parts:
            for toks in p[c0:c0 + chunk]:
                steps.extend(toks)
    return Trace(steps, trace.n_layers, trace.n_experts, trace.tokens)


def host_cost(trace: Trace, capacity: int, policy: str, repeat: int = 1) -> float:
    """Microseconds of policy bookkeeping per expert lookup (touch / insert / victim / remove) when the trace
    is replayed with the guess prefetch: the prefetcher's work on the decode path, less its ring traffic."""
    import time
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = simulate(trace, capacity, policy, prefetch=True)
        best = min(best, time.perf_counter() - t0)
    return best / max(r.accesses, 1) * 1e6


# ---------------------------------------------------------------------------------------------- the sweep
def sweep(trace: Trace, fractions=FRACTIONS, variants=None, references: bool = False) -> list[dict]:
    """Every variant (policy, prefetch, kwargs[, label]) at every cache fraction, beside Belady; with
    `references` also Belady with the guess prefetch and the fitted recency/frequency ranking."""
    variants = variants or [(name, pf, {}) for name in DEFAULT_POLICIES for pf in (False, True)]
    n_all = trace.n_layers * trace.n_experts
    top_k = max(len(ex) for _, ex, _ in trace.steps)
    rows = []
    for f in fractions:
        cap = max(top_k, round(f * n_all))
        rows.append({**belady(trace, cap).row(), "fraction": f})
        if references:
            rows.append({**belady_prefetch(trace, cap).row(), "fraction": f})
            rows.append({**fitted_ranking(trace, cap).row(), "fraction": f})
        for name, pf, kw, *tag in variants:
            res = simulate(trace, cap, name, pf, **kw)
            res.policy = name + (tag[0] if tag else "")
            rows.append({**res.row(), "fraction": f})
    return rows


def label(row) -> str:
    return row["policy"] + ("+prefetch" if row["prefetch"] else "")


def table(rows) -> str:
    labels = list(dict.fromkeys(label(r) for r in rows))
    fr = sorted({r["fraction"] for r in rows})
    by = {(label(r), r["fraction"]): r for r in rows}
    out = ["hit rate (reads per token) by cache size, % of all experts",
           f"{'policy':<28}" + "".join(f"{f * 100:>14.0f}%" for f in fr)]
    for lb in labels:
        out.append(f"{lb:<28}" + "".join(f"{by[lb, f]['hit_rate'] * 100:>7.1f} ({by[lb, f]['reads_per_token']:>5.1f})"
                                         for f in fr))
    gap = ["gap closed from LRU to Belady (demand policies: lru -> belady; prefetching ones: lru+prefetch -> "
           "belady+prefetch where that reference ran, else the demand ends)"]
    points = ["hit-rate points over LRU in the same mode (demand / with the guess prefetch)"]
    for lb in labels:
        if lb in ("lru", "belady", "lru+prefetch", "belady+prefetch"):
            continue
        same = "lru+prefetch" if "+prefetch" in lb else "lru"
        ends = ("lru+prefetch", "belady+prefetch") if same == "lru+prefetch" and ("belady+prefetch", fr[0]) in by \
            else ("lru", "belady")
        cells, pts = [], []
        for f in fr:
            lo, hi = by[ends[0], f]["hit_rate"], by[ends[1], f]["hit_rate"]
            cells.append(f"{(by[lb, f]['hit_rate'] - lo) / (hi - lo) * 100:>14.0f}%" if hi > lo else f"{'-':>15}")
            pts.append(f"{(by[lb, f]['hit_rate'] - by[same, f]['hit_rate']) * 100:>+15.1f}")
        gap.append(f"{lb:<28}" + "".join(cells))
        points.append(f"{lb:<28}" + "".join(pts))
    wasted = ["prefetch reads wasted (% of prefetch reads)"]
    for lb in labels:
        if "+prefetch" in lb:
            wasted.append(f"{lb:<28}" + "".join(
                f"{by[lb, f]['prefetch_wasted'] / max(by[lb, f]['prefetch_reads'], 1) * 100:>14.0f}%" for f in fr))
    return "\n".join(out + [""] + points + [""] + gap + [""] + wasted)


def plot(rows, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for lb in dict.fromkeys(label(r) for r in rows):
        pts = sorted((r["fraction"] * 100, r["hit_rate"] * 100) for r in rows if label(r) == lb)
        style = dict(color="black", linewidth=2.5) if lb == "belady" else \
            dict(color="black", linewidth=1.5, linestyle="--") if lb == "belady+prefetch" else \
            dict(color="black", linewidth=1.5, linestyle=":") if lb == "fitted" else \
            dict(linestyle="--" if "+prefetch" in lb else "-")
        ax.plot(*zip(*pts), marker="o", markersize=3, label=lb, **style)
    ax.axvspan(24, 34, color="orange", alpha=0.08, label="the original's 24-34 %")
    ax.set_xlabel("cache size, % of all routed experts")
    ax.set_ylabel("hit rate, %")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def record_trace(model: str, store: str, out: Path, prompts: int, decode: int, seed: int) -> None:
    """Rotating prompts through the streaming engine, every decode step's routing into one file."""
    import tempfile

    from tools import logits as logits_tool
    parts = []
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(prompts):
            ids = ",".join(str(int(t)) for t in rng.integers(14, 500, size=24))
            part = Path(tmp) / f"{i}.msgpack"
            rc = logits_tool.main(["--model", model, "--store", store, "--ids", ids, "--decode", str(decode),
                                   "--out", str(Path(tmp) / f"{i}.npz"), "--record-routing", str(part)])
            if rc:
                raise SystemExit(f"tools.logits failed ({rc})")
            parts.append(part.read_bytes())
    out.write_bytes(b"".join(parts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.policy_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", type=Path)
    ap.add_argument("--n-experts", type=int, help="routed experts per layer (default: the largest id seen + 1)")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    ap.add_argument("--half-lives", default="", help="also lrfu with these half-lives (in tokens), e.g. 2,8,32")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--title", default="")
    ap.add_argument("--synth-trace", type=Path, help="record a trace instead: rotating prompts through --store")
    ap.add_argument("--model")
    ap.add_argument("--store")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rotate", default="", metavar="USERS:CHUNK",
                    help="replay the trace as USERS conversations served CHUNK tokens at a time in turn")
    ap.add_argument("--no-references", action="store_true",
                    help="skip belady+prefetch and the fitted ranking (the slow rows)")
    ap.add_argument("--host-cost", type=float, default=0.0, metavar="FRACTION",
                    help="also time each policy's bookkeeping per lookup at this cache fraction")
    a = ap.parse_args(argv)
    if a.synth_trace:
        if not (a.model and a.store):
            ap.error("--synth-trace needs --model and --store")
        record_trace(a.model, a.store, a.synth_trace, a.prompts, a.decode, a.seed)
        return 0
    if not a.traces:
        ap.error("give one or more trace files")
    trace = read_trace(a.traces, a.n_experts)
    rot = ""
    if a.rotate:
        users, chunk = (int(x) for x in a.rotate.split(":"))
        trace, rot = rotate(trace, users, chunk), f", rotated: {users} conversations, {chunk} tokens a turn"
    variants = None
    if a.half_lives:
        per_token = len(trace.steps) / max(trace.tokens, 1) * max(len(ex) for _, ex, _ in trace.steps)
        variants = [(name, pf, {}) for name in DEFAULT_POLICIES if name != "lrfu" for pf in (False, True)] + [
            (name, pf, {"half_life": float(h) * per_token}, f"({h} tok)") for h in a.half_lives.split(",")
            for name, pf in (("lrfu", False), ("lrfu", True))]
    rows = sweep(trace, [float(f) for f in a.fractions.split(",")], variants, references=not a.no_references)
    top_k = max(len(ex) for _, ex, _ in trace.steps)
    head = (f"{', '.join(map(str, a.traces))}: {trace.tokens} tokens, {trace.n_layers} MoE layers x "
            f"{trace.n_experts} experts, top-{top_k}{rot}")
    print(head)
    print(table(rows))
    costs = {}
    if a.host_cost:
        cap = max(top_k, round(a.host_cost * trace.n_layers * trace.n_experts))
        costs = {name: host_cost(trace, cap, name, repeat=3) for name in DEFAULT_POLICIES}
        print(f"\nhost cost, us per expert lookup (policy bookkeeping, with prefetch, cache {a.host_cost:.0%}, "
              "best of 3): " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
    if a.json:
        a.json.write_text(json.dumps({"trace": head, "rows": rows, "host_cost_us_per_lookup": costs},
                                     indent=1) + "\n")
    if a.plot:
        plot(rows, a.plot, a.title or head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
