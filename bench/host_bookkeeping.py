"""Host bookkeeping per MoE layer at decode, on the CPU: the route path of `StreamingExperts` with a real cache.

Scenarios: hits (every block in the RAM cache), misses (the disk regime: a cache of a third of the blocks), vram
(a VRAM tier holding 90 % of them), staged (hits with the next layer's guessed ups staged, as the GPU's RAM regime
runs by default: `staging_on_cpu`), staged_dma (the same, its copies C calls that move no bytes: the GPU's host queues
them for the copy engine and never touches the bytes, where the CPU stand-in's memmove reads and writes ~150 KB a
layer: `staging_without_bytes`).

Goal (issue 19, part 3): ≤ 1 ms of host bookkeeping per token at Super's 40 MoE layers, i.e. ≤ 25 µs per layer.
What runs per layer is what `MoEStep.decide` and the stretch after it run on the host when the graphs are on:
the choice read from its pinned copy (`RouterOutputs.on_host`), `decode_route`, and, when every expert is
present, `ExpertInputs.set_addresses` and `decode_launched`. Between them, the source looks up the VRAM tier and
the cache (pinning hits), computes the block addresses, sends the one message, releases the previous layer's
pins and counts, each before or after the launch as the source does it. The device is the CPU, but the source
takes its CUDA path (block addresses from the slab, pins deferred past the kernels): nothing in that path
touches the device. No kernels run, so tensor sizes do not matter; the cost depends on k and the expert
count, so the model is the tiny synthetic one with Super's 512 experts and top-22.

Two figures per layer:
- critical path: from the choice on the host to the addresses staged, what the GPU waits for;
- after launch: `decode_launched`, which overlaps the next graph.
And for a layer with misses (no launch: its experts run eagerly as they land), request out: from the choice on the
host to the post that wakes the prefetcher with the layer's request. The disk reads of its misses start there, and
they take milliseconds, so this is what such a layer waits for; its route's return (the critical path above) only
lets the hits' kernels go, which finish long before the last miss lands.

Not in the figures (CUDA calls, not measurable here): the event record/sync, the graph replays, the H2D copy
launch inside `set_addresses` (here a CPU copy). Not in them either: waiting for the misses and the eager
expert kernels (`decode_eager`), which is time waiting for the disk, not bookkeeping.

Parts, wherever they run: lookup (`CacheClient.lookup` / `lookup_slots` / `lookup_all`, and `VramTier.lookup` /
`lookup_slots` where a tier is on), message (`CacheClient.request`), pin/release (`CacheClient.release`), staging (`on_host` +
`set_addresses`), other (the rest: tickets, lists, addresses, counts, admissions). The parts come from one pass
through timing wrappers. The wrappers' own cost is calibrated out, and `other` is what the pass's total leaves.
The critical path and the after-launch time come from a second pass without wrappers; that pass also counts the
layers whose critical path lost the core to another process (an involuntary context switch: on a small host the
cache processes, whose work a miss sets off) and gives the median and the mean of the rest. Each scenario runs
`--repeats` times, because the VM's CPU is shared; the median of each figure is reported.

    python -m bench.host_bookkeeping [--tokens 200] [--repeats 3] [--tag vm]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cache_shm.cuda_map import slab_tensor
from expert_store.reader import ExpertStore
from gpu_worker.cache_supervisor import Supervisor
from gpu_worker.decode_graphs import ExpertInputs, RouterOutputs
from gpu_worker.streaming import StreamingExperts
from gpu_worker.vram_tier import VramTier

SUPER_MOE_LAYERS = 40
GOAL_US_PER_LAYER = 1000 / SUPER_MOE_LAYERS
PARTS = ("lookup", "message", "pin_release", "staging", "other")
SCENARIOS = ("hits", "misses", "vram", "staged", "staged_dma")


def build_store(work: Path, experts: int, top_k: int) -> Path:
    from tools import repack, synth
    model = work / "model"
    synth.main(["--preset", "tiny", "--experts", str(experts), "--top-k", str(top_k), "--n-group", "1",
                "--topk-group", "1", "--out", str(model)])
    store = work / "store"
    assert repack.main(["--model", str(model), "--out", str(store), "--no-progress"]) == 0
    return store


def routing(n_tokens: int, n_moe: int, n_experts: int, k: int, seed: int, guess_right: int):
    """choice[t, j] (k distinct experts, skewed popularity per layer) and the guess for layer j + 1 sent with
    layer j: `guess_right` of its k are the next layer's actual choice, the rest other experts."""
    rng = np.random.default_rng(seed)
    pop = [rng.permutation(1.0 / (np.arange(n_experts) + 8.0) ** 0.9) for _ in range(n_moe)]
    pop = [p / p.sum() for p in pop]
    choice = np.array([[rng.choice(n_experts, k, replace=False, p=pop[j]) for j in range(n_moe)]
                       for _ in range(n_tokens)], dtype=np.int64)
    guess = np.empty_like(choice)
    for t in range(n_tokens):
        for j in range(n_moe):
            nt, nj = (t, j + 1) if j + 1 < n_moe else (t + 1, 0)
            nxt = choice[nt % n_tokens, nj]
            others = rng.permutation(np.setdiff1d(np.arange(n_experts), nxt))
            guess[t, j] = np.concatenate([nxt[:guess_right], others[:k - guess_right]])
    return choice, guess


class Meter:
    """Seconds per (phase, part); `phase` is where the host is: before the launch ("critical"), after it, or waiting
    for a layer's misses as `decode_eager` does ("eager", not the route's: left out of the parts)."""

    def __init__(self, overhead_s: float):
        self.overhead_s = overhead_s
        self.phase = "critical"
        self.s: dict = {}
        self.calls = 0

    def add(self, part: str, seconds: float) -> None:
        key = (self.phase, part)
        self.s[key] = self.s.get(key, 0.0) + seconds

    def wrap(self, fn, part: str):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.add(part, time.perf_counter() - t0 - self.overhead_s)
                self.calls += self.phase != "eager"     # (the eager phase is outside the timed stretches)
        return timed


class PostStamp:
    """The prefetcher's semaphore, stamping the time each post returned (when a request went out)."""

    def __init__(self, sem):
        self.sem, self.t = sem, 0.0

    def release(self) -> None:
        self.sem.release()
        self.t = time.perf_counter()

    def __getattr__(self, name):
        return getattr(self.sem, name)


def involuntary_switches() -> int:
    """This thread's involuntary context switches so far (the scheduler gave its core to another process)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def wrapper_overhead_s() -> float:
    """What one timing wrapper adds to the wall time around it (subtracted from parts and totals)."""
    m = Meter(0.0)
    w, f = m.wrap(lambda *a: None, "x"), (lambda *a: None)
    n = 20000
    best = []
    for fn in (w, f) * 3:
        t0 = time.perf_counter()
        for _ in range(n):
            fn(1, 2)
        best.append((time.perf_counter() - t0) / n)
    return max(min(best[0::2]) - min(best[1::2]), 0.0)


def cuda_path_on_cpu(src: StreamingExperts) -> StreamingExperts:
    """The host side of the CUDA path on the CPU: block addresses from the slab's pointer, pins deferred past
    the kernels. `decode_route` and `decode_launched` touch no device on that path."""
    src._cuda = src._addressed = True
    return src


def staging_on_cpu(src: StreamingExperts) -> StreamingExperts:
    """The RAM regime as the GPU runs it by default: the next layer's guessed ups staged after each launch
    (`decode_stage`), non-blocking (MOESTREAM_STAGE_EXTRA, the kernel waits per expert on a flag), so the route takes
    the staged ups (`UpStaging.take`), writes their addresses and each expert's (epoch, flag) and launch order. On
    the CPU the copies are synchronous; the source's non-blocking staging needs copies by the driver or a CPU source,
    so it keeps its CPU pins: a layer's pins are released in its `decode_launched` instead of the next layer's (the
    same phase, after a launch). Not here: the staging's event query in `take` (a CUDA call) and the copies' issue."""
    src._cuda = False
    src.stage_ups = True
    return src


def _no_bytes(dst: int, src: int, nbytes: int, stream=None) -> int:
    """A copy's C call that moves nothing (`host_memcpy`'s signature): what the host does for a DMA."""
    ctypes.memmove(dst, src, 0)
    return 0


def staging_without_bytes(src: StreamingExperts) -> StreamingExperts:
    """`staging_on_cpu`, the copies C calls of no bytes: the host's share of the GPU's staging (cuMemcpyAsync queues the
    copy; the copy engine moves the bytes) without the CPU's memmove of every up section, which takes the route's
    caches with it (VM, h-host13: after launch 54 -> 36 µs a layer, the critical path unchanged)."""
    staging_on_cpu(src)
    new_staging = src._new_staging

    def new(n: int):
        ups = new_staging(n)
        ups._memcpy = _no_bytes
        return ups
    src._new_staging = new
    return src


def run_scenario(store_dir: Path, scenario: str, tokens: int, seed: int, overhead_s: float) -> dict:
    store = ExpertStore.open(store_dir)
    n_moe, E = len(store.moe_layers), store.n_experts
    k = min(22, E)
    # hits / vram: the cache holds every block (warmed); misses: a third of them
    n_blocks = n_moe * E
    n_slots = n_blocks + 64 if scenario != "misses" else n_blocks // 3
    choice, guess = routing(tokens, n_moe, E, k, seed, guess_right=18)
    with Supervisor(store, n_slots=n_slots, n_workers=2, verify_checksums=False) as sup:
        client = sup.client()
        vram = None
        if scenario == "vram":     # the VRAM regime as measured (VRAM hit rate 0.90): a tier of 90 % of the blocks
            vram = VramTier(n_blocks * 9 // 10, store.block_stride, store.block_bytes, "cpu", admit_after=2)
        src = cuda_path_on_cpu(StreamingExperts(store, client, "cpu", slab_tensor(client.shm), vram=vram))
        if scenario == "staged":
            staging_on_cpu(src)
        elif scenario == "staged_dma":
            staging_without_bytes(src)
        ring = client.shm.msg_ring
        post = client.shm.sem_prefetcher = PostStamp(client.shm.sem_prefetcher)
        if scenario != "misses":
            for j in range(n_moe):
                client.request(j, list(range(E)), guess=())
                client.release([s for _, s in client.wait_any(j, list(range(E)))])
        outs = [RouterOutputs.alloc(torch.zeros(1, 8), k, 2, torch.zeros(2 * k, dtype=torch.long),
                                    torch.zeros(2 * k, dtype=torch.long))
                for _ in range(n_moe)]
        inps = [ExpertInputs.like(torch.zeros(1, 8), None, None, torch.zeros(1, k), pinned=False)
                for _ in range(n_moe)]
        ch_np = [o.choice_host.numpy() for o in outs]

        def token(t: int, meter: Meter | None, record: list | None):
            """One token's MoE layers as `MoEStep.decide` and the stretch after it run them on the host."""
            for j in range(n_moe):
                ch_np[j][:k] = choice[t, j]          # what R_j's copy leaves in pinned memory
                ch_np[j][k:] = guess[t, j]
                if meter is not None:
                    meter.phase = "critical"
                switches0 = involuntary_switches()      # outside the timed stretch, like the one after it
                t0 = time.perf_counter()
                chosen, g = outs[j].on_host()
                t_staging = time.perf_counter() - t0
                r = src.decode_route(j, j, chosen, g, 0.0)
                if r.addresses is not None:
                    t1 = time.perf_counter()
                    inps[j].set_addresses(r.addresses, r.up_addresses, r.up_waits)     # as MoEStep.decide does
                    t2 = time.perf_counter()             # here the next stretch's graph is launched
                    t_staging += t2 - t1
                    preempted = involuntary_switches() > switches0
                    if meter is not None:
                        meter.phase = "after_launch"
                    t3 = time.perf_counter()
                    src.decode_launched()
                    src.decode_stage()          # (a no-op unless the scenario stages ups)
                    t_after = time.perf_counter() - t3
                else:
                    t2 = time.perf_counter()
                    preempted = involuntary_switches() > switches0
                    t_after = 0.0
                    # decode_eager's wait for the misses (not bookkeeping), its releases as there (less its syncs)
                    if meter is not None:
                        meter.phase = "eager"            # not the route's: left out of the parts
                    missing = [e for e in r.rest if e not in r.hits]
                    src._defer(list(r.hits.values()))
                    src.decode_count(r)                  # the counts a request-first route leaves to decode_eager
                    if missing:
                        src._flush(sync=False)
                    for _, s in client.wait_any(j, missing):
                        src._defer([s])
                        if len(src._deferred) > 1:
                            src._flush(sync=False)
                if meter is not None:
                    meter.phase = "critical"
                    meter.add("staging", t_staging)
                if record is not None:
                    sent = post.t - t0 if r.addresses is None and post.t > t0 else float("nan")
                    record.append((t2 - t0, t_after, r.addresses is not None, preempted, sent))
            while len(ring):          # at real speed a message comes every ~1 ms of GPU time: the ring drains
                time.sleep(0.0001)

        # warm-up: steady-state cache contents (misses), VRAM-tier admissions, every code path run once
        for t in range(min(tokens, 100)):
            token(t, None, None)
        a = src.acct
        admitted = vram.admissions if vram is not None else 0
        staged_used = a.ups_staged_used
        before = (a.ms_bookkeeping, getattr(a, "ms_bookkeeping_after_launch", 0.0), a.hits_at_lookup,
                  a.misses_at_lookup, a.vram_hits, a.ms_bookkeeping_take)
        # pass 1: no wrappers
        rec: list = []
        for t in range(tokens):
            token(t, None, rec)
        after = (a.ms_bookkeeping, getattr(a, "ms_bookkeeping_after_launch", 0.0), a.hits_at_lookup,
                 a.misses_at_lookup, a.vram_hits, a.ms_bookkeeping_take)
        admitted = (vram.admissions if vram is not None else 0) - admitted
        staged_used = a.ups_staged_used - staged_used
        # pass 2: the parts, through timing wrappers
        meter = Meter(overhead_s)
        rec2: list = []
        client.lookup = meter.wrap(client.lookup, "lookup")
        client.request = meter.wrap(client.request, "message")
        client.release = meter.wrap(client.release, "pin_release")
        for name in ("lookup_slots", "lookup_all"):     # (the decode route's lookups, where the client has them)
            if hasattr(client, name):
                setattr(client, name, meter.wrap(getattr(client, name), "lookup"))
        if vram is not None:
            vram.lookup = meter.wrap(vram.lookup, "lookup")
            if hasattr(vram, "lookup_slots"):      # the decode route's lookup (its uses counted after the launch)
                vram.lookup_slots = meter.wrap(vram.lookup_slots, "lookup")
        for t in range(tokens):
            token(t, meter, rec2)
        for name in ("lookup", "request", "release", "lookup_slots", "lookup_all"):
            client.__dict__.pop(name, None)
        src._flush(sync=False)
        client.shm.sem_prefetcher = post.sem

    n_layers = tokens * n_moe
    us = lambda sec: sec * 1e6 / n_layers
    out = {}
    for part in PARTS[:-1]:
        out[part] = us(sum(v for (ph, p), v in meter.s.items() if p == part and ph != "eager"))
    # the wrapped pass's total less the wrappers' own cost
    calls_s = meter.calls * overhead_s
    total2 = us(sum(r[0] + r[1] for r in rec2) - calls_s)
    out["other"] = total2 - sum(out[p] for p in PARTS[:-1])
    out["total"] = total2
    out["critical_path"] = statistics.fmean(r[0] for r in rec) * 1e6
    out["after_launch"] = statistics.fmean(r[1] for r in rec) * 1e6
    out["total_unwrapped"] = out["critical_path"] + out["after_launch"]
    out["critical_parts"] = {p: us(v) for (ph, p), v in meter.s.items() if ph == "critical"}
    out["eager_parts"] = {p: us(v) for (ph, p), v in meter.s.items() if ph == "eager"}
    out["after_launch_parts"] = {p: us(v) for (ph, p), v in meter.s.items() if ph == "after_launch"}
    out["accounting_ms_bookkeeping_us"] = (after[0] - before[0]) * 1e3 / n_layers
    out["accounting_ms_bookkeeping_after_launch_us"] = (after[1] - before[1]) * 1e3 / n_layers
    out["accounting_ms_bookkeeping_take_us"] = (after[5] - before[5]) * 1e3 / n_layers     # of the bookkeeping
    out["p90_critical_path"] = float(np.percentile([r[0] for r in rec], 90) * 1e6)
    # On a host with few cores the cache processes (IO workers, prefetcher) take the CPU from the route path in
    # the middle of a layer now and then: the layers that lost it, and the critical path of the others
    out["median_critical_path"] = statistics.median(r[0] for r in rec) * 1e6
    kept = [r[0] for r in rec if not r[3]]
    out["preempted_share"] = 1 - len(kept) / len(rec)
    out["critical_path_not_preempted"] = statistics.fmean(kept) * 1e6 if kept else float("nan")
    out["addressed_share"] = sum(r[2] for r in rec) / len(rec)
    # layers with misses: the choice on the host -> their request posted (all of them, and the unpreempted ones)
    sent = [r[4] for r in rec if r[4] == r[4]]
    sent_kept = [r[4] for r in rec if r[4] == r[4] and not r[3]]
    out["request_out"] = statistics.fmean(sent) * 1e6 if sent else float("nan")
    out["median_request_out"] = statistics.median(sent) * 1e6 if sent else float("nan")
    out["request_out_not_preempted"] = statistics.fmean(sent_kept) * 1e6 if sent_kept else float("nan")
    out["ups_staged_used_per_layer"] = staged_used / n_layers
    hits, misses, vram_hits = (after[i] - before[i] for i in (2, 3, 4))
    looked = hits + misses + vram_hits
    out["hit_rate"] = (hits + vram_hits) / max(looked, 1)
    out["vram_hit_rate"] = vram_hits / max(looked, 1)
    out["vram_admissions_per_layer"] = admitted / n_layers
    return out


def run_slab_booking(store_dir: Path, tokens: int, seed: int) -> dict:
    """Slab routing's host work (gpu_worker/slab_routing.py), every layer held in the slab: per token, the source's
    `decode_slab_layers` at the token's start and the booking of each layer (`decode_routed`: the counts, the one
    message, the record, the staging's counts), all of it while the device runs the token, none before a kernel.
    µs per MoE layer, mean and median over `tokens` tokens."""
    from gpu_worker.slab_routing import DeviceStaging
    store = ExpertStore.open(store_dir)
    n_moe, E = len(store.moe_layers), store.n_experts
    k = min(22, E)
    choice, guess = routing(tokens, n_moe, E, k, seed, guess_right=18)
    per_token = []
    with Supervisor(store, n_slots=n_moe * E + 64, n_workers=2, verify_checksums=False) as sup:
        client = sup.client()
        src = cuda_path_on_cpu(StreamingExperts(store, client, "cpu", slab_tensor(client.shm)))
        src.stage_ups = src.slab_routing = True
        for j in range(n_moe):
            client.request(j, list(range(E)), guess=())
            client.release([s for _, s in client.wait_any(j, list(range(E)))])
        for _ in range(n_moe):                  # one layer held a token
            src.decode_slab_layers()
        assert src.slab_layers.held == frozenset(range(n_moe)), src.slab_layers.held
        src.dstage = DeviceStaging(n_moe, k, src._up_span, "cpu", 1)
        ring = client.shm.msg_ring
        warm = min(tokens, 50)
        for t in range(tokens + warm):
            tt = t % tokens
            records = [(j, choice[tt, j].tolist(), guess[tt, j].tolist()) for j in range(n_moe)]
            t0 = time.perf_counter()
            src.decode_slab_layers()
            src.decode_routed(records)
            if t >= warm:
                per_token.append(time.perf_counter() - t0)
            while len(ring):          # at real speed a message comes every ~1 ms of GPU time: the ring drains
                time.sleep(0.0001)
        a = src.acct
        used = a.ups_staged_used_by_sms / max(a.ups_staged_by_sms, 1)
        src.release_holds()
    per_layer = [x * 1e6 / n_moe for x in per_token]
    return dict(mean_us_per_layer=statistics.fmean(per_layer), median_us_per_layer=statistics.median(per_layer),
                p90_us_per_layer=float(np.percentile(per_layer, 90)), staged_read=used, moe_layers=n_moe)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=200, help="decoded tokens per repeat (× the store's MoE layers)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--store", type=Path, help="an existing store (default: a tiny one with 512 experts, top-22)")
    ap.add_argument("--tag", default="vm", help="names the result files bench/results/host_bookkeeping-TAG.*")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--slab", action="store_true", help="also slab routing's host work per layer (off the device's path)")
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise SystemExit(f"unknown scenario(s) {bad}; choose from {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory(prefix="host-bookkeeping-") as tmp:
        store_dir = args.store or build_store(Path(tmp), 512, 22)
        overhead_s = wrapper_overhead_s()
        runs = {s: [run_scenario(store_dir, s, args.tokens, args.seed + r, overhead_s) for r in range(args.repeats)]
                for s in scenarios}
        slab = ([run_slab_booking(store_dir, args.tokens, args.seed + r) for r in range(args.repeats)]
                if args.slab else None)
        geometry = ExpertStore.open(store_dir)
        geo = dict(moe_layers=len(geometry.moe_layers), experts=geometry.n_experts, top_k=22)
    flat = [k for k, v in runs[scenarios[0]][0].items() if not isinstance(v, dict)]
    med = {s: {key: statistics.median(r[key] for r in rs) for key in flat} for s, rs in runs.items()}
    lines = [f"host bookkeeping per MoE layer, µs (median of {args.repeats} runs × {args.tokens} tokens × "
             f"{geo['moe_layers']} MoE layers; {geo['experts']} experts, top-{geo['top_k']}; "
             f"timing wrapper {overhead_s * 1e9:.0f} ns calibrated out)", "",
             "| scenario | hit rate | lookup | message | pin/release | staging | other | total | **critical path** "
             "(p90) | after launch | Accounting: bookkeeping / after launch | critical ×40, ms/token | median | "
             "layers preempted: share (critical path of the rest) | layers with misses: request out (median; the "
             "unpreempted) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s, m in med.items():
        lines.append(f"| {s} | {m['hit_rate']:.3f} (VRAM {m['vram_hit_rate']:.3f}) | {m['lookup']:.1f} | "
                     f"{m['message']:.1f} | {m['pin_release']:.1f} | {m['staging']:.1f} | {m['other']:.1f} | "
                     f"{m['total']:.1f} | **{m['critical_path']:.1f}** ({m['p90_critical_path']:.1f}) | "
                     f"{m['after_launch']:.1f} | {m['accounting_ms_bookkeeping_us']:.1f} / "
                     f"{m['accounting_ms_bookkeeping_after_launch_us']:.1f} | "
                     f"{m['critical_path'] * SUPER_MOE_LAYERS / 1e3:.2f} | {m['median_critical_path']:.1f} | "
                     f"{m['preempted_share']:.2f} ({m['critical_path_not_preempted']:.1f}) | "
                     + ("—" if m["request_out"] != m["request_out"] else
                        f"{m['request_out']:.1f} ({m['median_request_out']:.1f}; {m['request_out_not_preempted']:.1f})")
                     + " |")
    lines.append(f"\nparts: through timing wrappers (one pass); critical path / after launch: a pass without them. "
                 f"Critical path = the choice on the host → the block addresses staged (what the GPU waits for); "
                 f"after launch = `decode_launched`, overlapped with the next stretch. Goal: ≤ "
                 f"{GOAL_US_PER_LAYER:.0f} µs per layer on the GPU host (≤ 1 ms per token at {SUPER_MOE_LAYERS} "
                 f"MoE layers). Preempted: an involuntary context switch of this thread inside the layer's critical "
                 f"path (its core given to another process, on a small host usually a cache process). Request out: the "
                 f"choice on the host → the post that wakes the prefetcher with the request, for the layers with "
                 f"misses (whose kernels wait for the disk reads it starts).")
    if slab:
        m = {key: statistics.median(r[key] for r in slab) for key in slab[0]}
        lines.append(f"\nslab routing (every layer held in the slab, routed on the device): the host's work per MoE layer "
                     f"{m['mean_us_per_layer']:.1f} µs (median {m['median_us_per_layer']:.1f}, p90 "
                     f"{m['p90_us_per_layer']:.1f}), {m['mean_us_per_layer'] * SUPER_MOE_LAYERS / 1e3:.2f} ms a token "
                     f"at {SUPER_MOE_LAYERS} MoE layers, none of it before a kernel (the token's start and the "
                     f"bookings, while the device runs the token); staged ups read {m['staged_read']:.2f}")
    text = "\n".join(lines)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"host_bookkeeping-{args.tag}.txt").write_text(text + "\n")
    (args.out_dir / f"host_bookkeeping-{args.tag}.json").write_text(json.dumps(
        dict(geometry=geo, tokens=args.tokens, repeats=args.repeats, wrapper_overhead_ns=overhead_s * 1e9,
             median=med, runs=runs, slab=slab, goal_us_per_layer=GOAL_US_PER_LAYER), indent=1) + "\n")


if __name__ == "__main__":
    main()
