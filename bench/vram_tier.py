"""The VRAM tier's share on an 8 GB card: what a tier of 0.5–2 GiB of expert blocks saves on the bus.

    python -m bench.vram_tier TRACE.msgpack [TRACE ...] [--n-experts E] [--down-fraction 0.71]
        [--tiers-gib 0.5,1,1.5,2] [--bus-gbps 26] [--synth-repeat 0.40] [--json OUT.json] [--plot OUT.png]

Input: decode routing traces (`python -m tools.logits --store S --record-routing FILE`, read with
bench.policy_sim.read_trace). Measured on the trace: the next-token repeat rate (the share of a layer's chosen
experts that the same layer chose at the previous token: the original measured 40 %), and per tier policy
the share of expert uses served from VRAM and the admissions (block copies into the tier) per use.

Projected to Super (40 MoE layers x top-22 = 880 expert uses per token; a 3,096,576-byte block, up 1,548,288 B
read whole, down read for the groups holding an active neuron: --down-fraction of its 1,548,288 B): an expert
used from the pinned slab moves up + down-fraction x down over PCIe (zero-copy); one in the VRAM tier moves
nothing; an admission copies the whole block. Bytes per token and ms per token at --bus-gbps follow.

The trace's model is rarely Super-sized, so a tier is mapped by its share of one token's working set: a tier
of C blocks is C / 880 of Super's per-token experts, and holds that share of the trace's n_moe x top-k. A
Super-shaped synthetic trace (bench.policy_sim.synthetic_trace, its skew tuned to --synth-repeat) is run
beside it at Super's own sizes, so the mapping can be checked against a trace that needs none.

Policies: `engine` runs gpu_worker/vram_tier.py's VramTier itself (CPU, one-byte blocks: frequency admission
with a decayed use count, the engine's defaults); `lru2` is the engine's former rule (admitted on the 2nd use
from the slab, evicted least recently used); `lru` admits on the first use; `freq` admits a missed expert only over a less used resident
(use counts over the whole history); `static` pins the experts used most often in the first half
of the trace and is scored on the second half (no admissions after the start: a one-time fill); `oracle`
pins the most used of the whole trace (an in-sample upper bound for a static tier).

The VRAM budget (assumed, printed): 8 GiB card; dense part 6.6 GiB (MISSION.md), of which embeddings and
lm_head are 131,072 x 4,096 bf16 = 1 GiB each; the engine's reserve for activations / KV / Mamba state
512 MiB (gpu_worker/engine.py's default).
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter, OrderedDict
from pathlib import Path

import torch

from bench.report import emit
from bench.policy_sim import Trace, read_trace, synthetic_trace
from gpu_worker.vram_tier import VramTier

GIB = 2 ** 30
SUPER = dict(moe_layers=40, n_experts=512, top_k=22, block_bytes=3_096_576, up_bytes=1_548_288,
             down_bytes=1_548_288, vocab=131_072, hidden=4_096)
CARD_GIB, DENSE_GIB, RESERVE_GIB = 8.0, 6.6, 0.5
TIERS_GIB = (0.5, 1.0, 1.5, 2.0)
POLICIES = ("engine", "lru2", "lru", "freq", "static", "oracle")


def repeat_rate(trace: Trace) -> float:
    """Share of a layer's chosen experts that the same layer chose at the previous token."""
    last: dict[int, set] = {}
    same = total = 0
    for j, ex, _ in trace.steps:
        prev = last.get(j)
        if prev is not None:
            same += len(prev.intersection(ex))
            total += len(ex)
        last[j] = set(ex)
    return same / max(total, 1)


def tier_replay(trace: Trace, capacity: int, policy: str) -> dict:
    """Uses served from the tier, and admissions (whole-block copies), over the scored part of the trace."""
    steps = trace.steps
    uses = hits = admissions = 0
    if policy in ("static", "oracle"):
        fit = steps[:len(steps) // 2] if policy == "static" else steps
        scored = steps[len(steps) // 2:] if policy == "static" else steps
        count = Counter(trace.key(j, e) for j, ex, _ in fit for e in ex)
        pinned = {k for k, _ in count.most_common(capacity)}
        for j, ex, _ in scored:
            for e in ex:
                uses += 1
                hits += trace.key(j, e) in pinned
        return dict(uses=uses, hits=hits, admissions=0, fill_blocks=len(pinned))
    if policy == "freq":
        return _freq_replay(trace, capacity)
    if policy == "engine":
        return _engine_replay(trace, capacity)
    admit_after = 2 if policy == "lru2" else 1
    lru: OrderedDict[int, None] = OrderedDict()
    seen: Counter = Counter()
    for j, ex, _ in steps:
        for e in ex:                       # the former gpu_worker/vram_tier.py: lookup first, then admit
            k = trace.key(j, e)
            uses += 1
            if k in lru:
                hits += 1
                lru.move_to_end(k)
                continue
            seen[k] += 1
            if capacity and seen[k] >= admit_after:
                if len(lru) >= capacity:
                    lru.popitem(last=False)
                lru[k] = None
                admissions += 1
    return dict(uses=uses, hits=hits, admissions=admissions, fill_blocks=0)


def _engine_replay(trace: Trace, capacity: int) -> dict:
    """The engine's own tier, driven as gpu_worker/streaming.py drives it: one lookup per layer, then `want`
    (and `admit` from a slab slot) for every expert the lookup did not find."""
    vt = VramTier(capacity, 1, 1, "cpu")
    src = torch.zeros(1, dtype=torch.uint8)
    uses = 0
    for j, ex, _ in trace.steps:
        ex = list(ex)
        uses += len(ex)
        on_dev = vt.lookup(j, ex)
        for e in ex:
            if e not in on_dev and vt.want(j, e):
                vt.admit(j, e, src)
    return dict(uses=uses, hits=vt.hits, admissions=vt.admissions, fill_blocks=0)


def _freq_replay(trace: Trace, capacity: int) -> dict:
    """Frequency admission: a missed expert replaces the least-used resident only if it has been used more
    often (counts over the whole history), so a tier smaller than one token's working set does not churn."""
    import heapq
    count: Counter = Counter()
    resident: set[int] = set()
    heap: list[tuple[int, int]] = []          # (count when pushed, key); stale entries skipped
    uses = hits = admissions = 0
    for j, ex, _ in trace.steps:
        for e in ex:
            k = trace.key(j, e)
            uses += 1
            count[k] += 1
            if k in resident:
                hits += 1
                heapq.heappush(heap, (count[k], k))
                continue
            if not capacity:
                continue
            if len(resident) < capacity:
                resident.add(k)
            else:
                while heap[0][1] not in resident or heap[0][0] != count[heap[0][1]]:
                    heapq.heappop(heap)
                if heap[0][0] >= count[k]:
                    continue
                resident.discard(heapq.heappop(heap)[1])
                resident.add(k)
            heapq.heappush(heap, (count[k], k))
            admissions += 1
    return dict(uses=uses, hits=hits, admissions=admissions, fill_blocks=0)


def super_bytes(hit_share: float, admissions_per_use: float, down_fraction: float) -> float:
    """PCIe bytes per Super token for a tier serving hit_share of the uses."""
    s = SUPER
    uses = s["moe_layers"] * s["top_k"]
    per_use = s["up_bytes"] + down_fraction * s["down_bytes"]
    return uses * ((1 - hit_share) * per_use + admissions_per_use * s["block_bytes"])


def vram_budget() -> dict:
    table_bytes = SUPER["vocab"] * SUPER["hidden"] * 2
    free = (CARD_GIB - DENSE_GIB - RESERVE_GIB) * GIB
    return dict(card_gib=CARD_GIB, dense_gib=DENSE_GIB, reserve_gib=RESERVE_GIB, tier_room_gib=free / GIB,
                embeddings_gib=table_bytes / GIB, lm_head_gib=table_bytes / GIB,
                tier_room_embeddings_in_host_gib=(free + table_bytes) / GIB,
                # one embedding row per token crosses the bus; the lm_head would cross whole (a GEMV over it)
                embeddings_in_host_bytes_per_token=SUPER["hidden"] * 2,
                lm_head_in_host_bytes_per_token=table_bytes)


def evaluate(trace: Trace, name: str, tiers_gib, down_fraction: float, bus_gbps: float, scale: bool) -> dict:
    s = SUPER
    super_uses = s["moe_layers"] * s["top_k"]
    top_k = max(len(ex) for _, ex, _ in trace.steps)
    trace_uses = trace.n_layers * top_k
    base = super_bytes(0.0, 0.0, down_fraction)
    rows = []
    for gib in tiers_gib:
        blocks = int(gib * GIB // s["block_bytes"])
        cap = round(blocks / super_uses * trace_uses) if scale else blocks
        for pol in POLICIES:
            r = tier_replay(trace, cap, pol)
            h, a = r["hits"] / max(r["uses"], 1), r["admissions"] / max(r["uses"], 1)
            b = super_bytes(h, a, down_fraction)
            rows.append(dict(tier_gib=gib, tier_blocks=blocks, capacity_in_trace=cap, policy=pol, hit_share=h,
                             admissions_per_use=a, bytes_per_token=b, bytes_saved_per_token=base - b,
                             ms_per_token=b / (bus_gbps * 1e9) * 1e3,
                             ms_saved_per_token=(base - b) / (bus_gbps * 1e9) * 1e3))
    return dict(trace=name, tokens=trace.tokens, moe_layers=trace.n_layers, n_experts=trace.n_experts,
                top_k=top_k, scaled_by_working_set=scale, repeat_rate=repeat_rate(trace),
                base_bytes_per_token=base, base_ms_per_token=base / (bus_gbps * 1e9) * 1e3, rows=rows)


def tune_synth_trace(target_repeat: float, tokens: int, seed: int) -> tuple[Trace, float]:
    """A Super-shaped synthetic trace whose next-token repeat rate is near target (bisection on its skew)."""
    lo, hi = 0.05, 5.0
    best = None
    for _ in range(8):
        mid = (lo * hi) ** 0.5
        t = synthetic_trace(SUPER["moe_layers"], SUPER["n_experts"], SUPER["top_k"], tokens, mid, seed)
        r = repeat_rate(t)
        if best is None or abs(r - target_repeat) < abs(best[1] - target_repeat):
            best = (t, r, mid)
        lo, hi = (mid, hi) if r > target_repeat else (lo, mid)   # lower skew exponent: more concentrated
    return best[0], best[2]


def table(res: dict) -> str:
    b = res["budget"]
    out = [f"VRAM budget (assumed): {b['card_gib']:.1f} GiB card - {b['dense_gib']:.1f} GiB dense - "
           f"{b['reserve_gib']:.1f} GiB reserve = {b['tier_room_gib']:.2f} GiB for a tier; embeddings in host "
           f"memory free {b['embeddings_gib']:.2f} GiB more ({b['tier_room_embeddings_in_host_gib']:.2f} GiB) at "
           f"{b['embeddings_in_host_bytes_per_token']:,} B/token over the bus; the lm_head in host memory frees "
           f"{b['lm_head_gib']:.2f} GiB but moves {b['lm_head_in_host_bytes_per_token'] / 1e9:.2f} GB/token "
           f"({b['lm_head_in_host_bytes_per_token'] / (res['bus_gbps'] * 1e9) * 1e3:.0f} ms at "
           f"{res['bus_gbps']:g} GB/s)",
           f"Super per token without a tier: 880 uses x (up + {res['down_fraction']:.2f} x down) over PCIe"]
    for e in res["evaluations"]:
        mapping = ("tier mapped by share of the per-token working set" if e["scaled_by_working_set"]
                   else "tier at Super size")
        out.append(f"\n{e['trace']}: {e['tokens']} tokens, {e['moe_layers']} MoE layers x {e['n_experts']} experts, "
                   f"top-{e['top_k']}; next-token repeat rate {e['repeat_rate']:.1%}; {mapping}")
        out.append(f"  no tier: {e['base_bytes_per_token'] / 1e9:.3f} GB/token, {e['base_ms_per_token']:.1f} ms/token")
        out.append(f"  {'tier GiB':>8} {'blocks':>6} {'in trace':>8} {'policy':>7} {'served':>7} {'admit/use':>9} "
                   f"{'GB/token':>9} {'saved MB':>9} {'ms/token':>9} {'saved ms':>9}  fits on 8 GiB")
        for r in e["rows"]:
            fits = ("yes" if r["tier_gib"] <= b["tier_room_gib"] else
                    "embeddings out" if r["tier_gib"] <= b["tier_room_embeddings_in_host_gib"] else "no")
            out.append(f"  {r['tier_gib']:>8.1f} {r['tier_blocks']:>6} {r['capacity_in_trace']:>8} {r['policy']:>7} "
                       f"{r['hit_share']:>7.1%} {r['admissions_per_use']:>9.3f} {r['bytes_per_token'] / 1e9:>9.3f} "
                       f"{r['bytes_saved_per_token'] / 1e6:>9.1f} {r['ms_per_token']:>9.2f} "
                       f"{r['ms_saved_per_token']:>9.2f}  {fits}")
    return "\n".join(out)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ev = res["evaluations"]
    fig, axes = plt.subplots(1, len(ev), figsize=(5.5 * len(ev), 4), squeeze=False)
    for ax, e in zip(axes[0], ev):
        for pol in POLICIES:
            rows = [r for r in e["rows"] if r["policy"] == pol]
            ax.plot([r["tier_gib"] for r in rows], [r["ms_saved_per_token"] for r in rows], marker="o", label=pol)
        ax.axvline(res["budget"]["tier_room_gib"], color="grey", ls="--", lw=0.8)
        ax.axvline(res["budget"]["tier_room_embeddings_in_host_gib"], color="grey", ls=":", lw=0.8)
        ax.set_xlabel("VRAM tier (GiB); dashed: room on 8 GiB, dotted: embeddings in host")
        ax.set_ylabel(f"PCIe ms saved per Super token at {res['bus_gbps']:g} GB/s")
        ax.set_title(f"{Path(e['trace']).name[:40]} (repeat {e['repeat_rate']:.0%})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vram_tier", description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", type=Path, help="--record-routing files (one model, concatenated)")
    ap.add_argument("--n-experts", type=int)
    ap.add_argument("--down-fraction", type=float, default=1 - 0.925 ** 16,
                    help="share of down bytes read per use (default: 92.5%% zeros placed independently, "
                         "16-neuron groups = 0.71; bench.down_groups measures it per model)")
    ap.add_argument("--tiers-gib", default=",".join(map(str, TIERS_GIB)))
    ap.add_argument("--bus-gbps", type=float, default=26.0)
    ap.add_argument("--synth-repeat", type=float, default=0.40,
                    help="also a Super-shaped synthetic trace tuned to this repeat rate (0: none)")
    ap.add_argument("--synth-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args(argv)
    if not (0 <= a.down_fraction <= 1):
        ap.error("--down-fraction must be in [0, 1]")
    tiers = [float(t) for t in a.tiers_gib.split(",")]
    evals = []
    if a.traces:
        evals.append(evaluate(read_trace(a.traces, a.n_experts), ", ".join(map(str, a.traces)), tiers,
                              a.down_fraction, a.bus_gbps, scale=True))
    if a.synth_repeat:
        t, skew = tune_synth_trace(a.synth_repeat, a.synth_tokens, a.seed)
        evals.append(evaluate(t, f"synthetic Super-shaped trace (skew {skew:.2f})", tiers, a.down_fraction,
                              a.bus_gbps, scale=False))
    if not evals:
        ap.error("give a trace file or --synth-repeat")
    res = dict(bus_gbps=a.bus_gbps, down_fraction=a.down_fraction, budget=vram_budget(), super=SUPER,
               evaluations=evals)
    emit(res, table, plot, a.json, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
