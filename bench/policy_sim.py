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

Policies: the prefetcher's own classes (`prefetcher/policy.py`: lru, lfu, lrfu), each demand-only and with the
guess prefetch, and Belady's MIN (evict the expert whose next use is farthest; demand only): no demand policy
misses less, so it bounds every demand policy's hit rate. Prefetching reads beyond the demand misses (its
wasted reads are counted), so a prefetching policy may pass the demand bound in hit rate while reading more.

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


# ---------------------------------------------------------------------------------------------- the sweep
def sweep(trace: Trace, fractions=FRACTIONS, variants=None) -> list[dict]:
    variants = variants or [("lru", False, {}), ("lru", True, {}), ("lfu", False, {}), ("lfu", True, {}),
                            ("lrfu", False, {}), ("lrfu", True, {})]      # (policy, prefetch, kwargs[, label])
    n_all = trace.n_layers * trace.n_experts
    top_k = max(len(ex) for _, ex, _ in trace.steps)
    rows = []
    for f in fractions:
        cap = max(top_k, round(f * n_all))
        rows.append({**belady(trace, cap).row(), "fraction": f})
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
    gap = ["gap closed from LRU to Belady (demand policies; prefetching ones against the same two ends)"]
    for lb in labels:
        if lb in ("lru", "belady"):
            continue
        cells = []
        for f in fr:
            lo, hi = by["lru", f]["hit_rate"], by["belady", f]["hit_rate"]
            cells.append(f"{(by[lb, f]['hit_rate'] - lo) / (hi - lo) * 100:>14.0f}%" if hi > lo else f"{'-':>15}")
        gap.append(f"{lb:<28}" + "".join(cells))
    wasted = ["prefetch reads wasted (% of prefetch reads)"]
    for lb in labels:
        if "+prefetch" in lb:
            wasted.append(f"{lb:<28}" + "".join(
                f"{by[lb, f]['prefetch_wasted'] / max(by[lb, f]['prefetch_reads'], 1) * 100:>14.0f}%" for f in fr))
    return "\n".join(out + [""] + gap + [""] + wasted)


def plot(rows, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for lb in dict.fromkeys(label(r) for r in rows):
        pts = sorted((r["fraction"] * 100, r["hit_rate"] * 100) for r in rows if label(r) == lb)
        style = dict(color="black", linewidth=2.5) if lb == "belady" else \
            dict(linestyle="--" if "+prefetch" in lb else "-")
        ax.plot(*zip(*pts), marker="o", markersize=3, label=lb, **style)
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
    a = ap.parse_args(argv)
    if a.synth_trace:
        if not (a.model and a.store):
            ap.error("--synth-trace needs --model and --store")
        record_trace(a.model, a.store, a.synth_trace, a.prompts, a.decode, a.seed)
        return 0
    if not a.traces:
        ap.error("give one or more trace files")
    trace = read_trace(a.traces, a.n_experts)
    variants = None
    if a.half_lives:
        per_token = len(trace.steps) / max(trace.tokens, 1) * max(len(ex) for _, ex, _ in trace.steps)
        variants = [("lru", False, {}), ("lru", True, {}), ("lfu", False, {}), ("lfu", True, {})] + [
            (name, pf, {"half_life": float(h) * per_token}, f"({h} tok)") for h in a.half_lives.split(",")
            for name, pf in (("lrfu", False), ("lrfu", True))]
    rows = sweep(trace, [float(f) for f in a.fractions.split(",")], variants)
    head = (f"{', '.join(map(str, a.traces))}: {trace.tokens} tokens, {trace.n_layers} MoE layers x "
            f"{trace.n_experts} experts, top-{max(len(ex) for _, ex, _ in trace.steps)}")
    print(head)
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps({"trace": head, "rows": rows}, indent=1) + "\n")
    if a.plot:
        plot(rows, a.plot, a.title or head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
