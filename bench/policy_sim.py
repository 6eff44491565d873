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

Policies: the prefetcher's own classes (`prefetcher/policy.py`: lru, lfu, lrfu, slru, arc, reuse), each demand-only
and with the guess prefetch (a policy with `observe` is shown each record's layer message first; one with `admit` may
refuse a read ahead, counted as `prefetch_refused`), and Belady's MIN (evict the expert whose next use is farthest; demand only): no demand
policy misses less, so it bounds every demand policy's hit rate. Prefetching reads beyond the demand misses (its
wasted reads are counted), so a prefetching policy may pass the demand bound in hit rate while reading more.
Two references beside them (`--no-references` skips them): `belady+prefetch`, MIN's eviction with the same reads
ahead (what eviction could add to the guess; not a bound), and `fitted`, the ranking by (tokens since the last
use, uses so far) with the reuse probabilities counted on the trace itself — an in-sample, optimistic bound for
recency/frequency policies: what no such policy can beat by much. `--rotate U:C` replays the trace as U
conversations served C tokens at a time in turn; `--host-cost F` times each policy's bookkeeping per lookup.

The traces and the counts live in bench/policy_trace.py, Belady and the references in bench/policy_bounds.py.

Assumptions: every prefetch lands before the next layer needs it (an upper bound on what prefetching buys
and on the reads it wastes); a guessed expert not used by the time it is evicted, or by the end, is wasted.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bench.policy_bounds import (belady, belady_prefetch, fitted_ranking, fitted_table,  # noqa: F401 (re-exported)
                                 next_use_table)
from bench.policy_trace import Result, Trace, read_trace, rotate, synthetic_trace, token_of_steps  # noqa: F401
from prefetcher.policy import POLICIES, make_policy

FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)
DEFAULT_POLICIES = ("lru", "lfu", "lrfu", "slru", "arc", "reuse")


def simulate(trace: Trace, capacity: int, policy: str, prefetch: bool = False, observe_first: bool = False,
             guess_ranks: int | None = None, **policy_kw) -> Result:
    """Replay the trace through one of the prefetcher's policies (slot = expert key, as one expert has at most
    one slot). A policy with `observe` learns from each record after its demand reads and before its reads ahead,
    as the prefetcher does (prefetcher/core.py `dispatch`); `observe_first`: before its demand reads.
    guess_ranks: the guess cut to its first `guess_ranks` experts (the next router's likeliest), as the engine sends
    it under MOESTREAM_PREFETCH_GUESS_RANKS: the others are neither read ahead nor touched; None: all of them."""
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

    observe = getattr(pol, "observe", None)          # policies that read the layer message (ReusePolicy)
    admit = getattr(pol, "admit", None)

    def make_room(key=None):
        """Free a slot; with `key` (a read ahead) a policy with `admit` may refuse it instead."""
        if len(resident) < capacity:
            return True
        victim = pol.choose_victim(lambda s: s not in pinned)
        if victim is not None and key is not None and admit is not None and not admit(key, victim):
            r.prefetch_refused += 1
            return False
        if victim is None:
            return False
        pol.remove(victim)
        resident.discard(victim)
        if victim in unused_prefetch:
            unused_prefetch.discard(victim)
            r.prefetch_wasted += 1
        return True

    for j, ex, guess in trace.steps:
        if guess_ranks is not None:
            guess = guess[:guess_ranks]
        step = [trace.key(j, e) for e in ex]
        pinned = set(step)
        if observe is not None and observe_first:
            observe(j, ex, (j + 1) % trace.n_layers if prefetch else None, guess if prefetch else ())
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
        if observe is not None and not observe_first:
            observe(j, ex, (j + 1) % trace.n_layers if prefetch else None, guess if prefetch else ())
        if prefetch:
            nj = (j + 1) % trace.n_layers
            for e in guess:
                k = trace.key(nj, e)
                if k in resident:
                    pol.touch(k, k)
                elif make_room(k):
                    pinned.add(k)          # the reads in flight are not victims of each other
                    pol.insert(k, k)
                    resident.add(k)
                    unused_prefetch.add(k)
                    r.prefetch_reads += 1
    r.prefetch_wasted += len(unused_prefetch)
    return r


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


def guess_rank_sweep(trace: Trace, fraction: float, ranks, policy: str = "reuse") -> list[dict]:
    """One policy with the guess prefetch capped at each of `ranks` (0: demand only) at one cache fraction: how the
    reads a token costs (demand + ahead) and the wasted reads ahead move with the guess's depth. Where the disk sets
    the pace every read costs its time, so the fewest reads a token win unless the demand reads they leave are
    waited for while the disk idles (the replay cannot say: it has no clock)."""
    n_all = trace.n_layers * trace.n_experts
    top_k = max(len(ex) for _, ex, _ in trace.steps)
    cap = max(top_k, round(fraction * n_all))
    rows = []
    for r in ranks:
        res = simulate(trace, cap, policy, prefetch=r > 0, guess_ranks=r or None)
        t = max(res.tokens, 1)
        rows.append({**res.row(), "fraction": fraction, "guess_ranks": r,
                     "demand_per_token": res.demand_reads / t, "ahead_per_token": res.prefetch_reads / t,
                     "wasted_per_token": res.prefetch_wasted / t})
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
    refused = ["reads ahead refused by the policy's admission (per token; not read, not in the reads above)"]
    for lb in labels:
        if "+prefetch" in lb and any(by[lb, f].get("prefetch_refused", 0) for f in fr):
            refused.append(f"{lb:<28}" + "".join(
                f"{by[lb, f]['prefetch_refused'] / max(by[lb, f]['tokens'], 1):>15.1f}" for f in fr))
    return "\n".join(out + [""] + points + [""] + gap + [""] + wasted + ([""] + refused if len(refused) > 1 else []))


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
    ap.add_argument("--guess-ranks", default="", metavar="R1,R2,...",
                    help="instead of the sweep: the reuse policy with the guess read ahead to each depth (0: none), "
                         "at the first of --fractions")
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
    if a.guess_ranks:
        f = float(a.fractions.split(",")[0])
        rows = guess_rank_sweep(trace, f, [int(r) for r in a.guess_ranks.split(",")])
        print(f"{', '.join(map(str, a.traces))}: {trace.tokens} tokens{rot}; reuse policy, cache {f:.0%}, reads a "
              "token by the guess's depth read ahead")
        print("guess ranks | hit rate | demand | ahead | wasted ahead | all reads")
        for r in rows:
            print(f"{r['guess_ranks']} | {r['hit_rate']:.3f} | {r['demand_per_token']:.2f} | "
                  f"{r['ahead_per_token']:.2f} | {r['wasted_per_token']:.2f} | {r['reads_per_token']:.2f}")
        if a.json:
            a.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        return 0
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
