"""Where a decode token's wall time goes on the device: the bus's readers against everything else (issue 19).

    python -m bench.decode_timeline --work DIR [--moe-layers 4] [--tokens 12] [--out OUT.json]

The RAM regime (every expert cached, the engine's defaults: CUDA graphs, staged ups). A token's expert bytes cross
the bus two ways, and both count as the bus at work: the expert kernels' zero-copy reads of the pinned slab (a
kernel whose name is in EXPERT_KERNELS) and the staging's copies (every host-to-device copy, and the SM copies of
slab-routed layers' ups: a kernel whose name is in STAGING_KERNELS, gpu_worker/slab_routing.py). All other kernels are
the dense part. Each token (on the host, from one sampled token read to the next, as generate() takes steps: the
next step's first stretch is queued before the read, session 26; so the device's work for the token is inside, its
first stretch but for the host's wake-up) is cut into what ran at each instant:

  both      the bus's readers and a dense kernel at once (the staging's overlap)
  bus       only the bus's readers (expert kernels, staging copies)
  dense     only dense kernels: the bus idles
  neither   the device idles: the host's decision per MoE layer, launches, the sampled token's sync

The host's side (session 22): named ranges around the step's parts that the device may wait for (HOST_RANGES: the
sampled token's sync, `token_ids`, `DecodeGraphs`' bind and plan, the source's settle, route, launched and stage),
their mean µs a token (`host_us_per_token`; the route also as its first call of a token, MoE 0's, whose stretch holds
the sampled token's round trip).

bench/NOTES.md's model of a token, wall ≈ D + (B − s) / r: D is everything but the expert kernels. `bus idle` (dense
+ neither) is the time D leaves the bus unused: what the staging could still fill. torch.profiler (CUPTI) records
the kernels inside the CUDA graphs' replays by name.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from bench.prefill_timeline import intersect, length, union

EXPERT_KERNELS = ("_expert_layer_kernel", "_expert_up_kernel", "_sparse_down_kernel", "_sparse_down_sub_kernel",
                  "_vram_up_kernel", "_vram_down_compact_kernel")
STAGING_KERNELS = ("_stage_ups_kernel",)
KINDS = ("both", "bus", "dense", "neither")
# the host's ranges a profiled token records: (name, object attribute path on the engine) — the token's sync is
# recorded by the loop itself
HOST_PARTS = (("token_ids", "model.token_ids"), ("bind", "graphs._bind"), ("device_layers", "graphs._device_layers"),
              ("plan", "graphs._plan"), ("settle", "experts.decode_settle"), ("route", "experts.decode_route"),
              ("launched", "experts.decode_launched"), ("stage", "experts.decode_stage"))
HOST_RANGES = ("token_sync",) + tuple(name for name, _ in HOST_PARTS)


def host_us_per_token(trace: dict, tokens: list[tuple[float, float]]) -> dict:
    """The host ranges' (HOST_RANGES) mean µs a token inside the tokens' windows, and `route_first`: the first route
    of each token (MoE 0's) alone."""
    out = {name: 0.0 for name in HOST_RANGES}
    first: dict[int, tuple[float, float]] = {}       # token -> (start, µs) of its earliest route
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != "user_annotation" or e.get("name") not in HOST_RANGES:
            continue
        ts, dur = float(e["ts"]), float(e.get("dur", 0))
        i = next((i for i, (lo, hi) in enumerate(tokens) if lo <= ts < hi), None)
        if i is None:
            continue
        out[e["name"]] += dur
        if e["name"] == "route" and (i not in first or ts < first[i][0]):
            first[i] = (ts, dur)
    out["route_first"] = sum(dur for _, dur in first.values())
    return {name: us / max(len(tokens), 1) for name, us in out.items()}


def _ranged_parts(eng) -> None:
    """Each of HOST_PARTS on the engine wrapped in a profiler range of its name (for the profiled pass)."""
    from bench.prefill_timeline import ranged
    for name, path in HOST_PARTS:
        owner_path, attr = path.rsplit(".", 1)
        owner = eng
        for part in owner_path.split("."):
            owner = getattr(owner, part)
        setattr(owner, attr, ranged(getattr(owner, attr), name))


def is_expert(name: str) -> bool:
    return any(k in name for k in EXPERT_KERNELS)


def is_staging(e: dict) -> bool:
    """A staging copy: by the copy engine (host to device), or by the SMs' staging kernel."""
    if e["kind"] == "copy":
        return e.get("h2d", True)
    return any(k in e["name"] for k in STAGING_KERNELS)


def token_split(events: list[dict], lo: float, hi: float) -> dict:
    """events: the device's [{kind: 'copy'|'kernel', ts, dur, name, h2d}] (µs). Over [lo, hi): the KINDS split, the
    expert kernels' and the host-to-device copies' busy time, and the bus's idle time."""
    experts = union((e["ts"], e["ts"] + e["dur"]) for e in events if e["kind"] == "kernel" and is_expert(e["name"]))
    copies = union((e["ts"], e["ts"] + e["dur"]) for e in events if is_staging(e))
    dense = union((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e["kind"] == "kernel" and not is_expert(e["name"]) and not is_staging(e))
    bus = union(experts + copies)
    b, d = length(bus, lo, hi), length(dense, lo, hi)
    both = length(intersect(bus, dense), lo, hi)
    wall = hi - lo
    return dict(wall=wall, both=both, bus=b - both, dense=d - both, neither=wall - (b + d - both),
                expert_kernels=length(experts, lo, hi), copies=length(copies, lo, hi),
                copies_beside_experts=length(intersect(copies, experts), lo, hi), bus_idle=wall - b)


def copy_bytes(events: list[dict], lo: float, hi: float) -> float:
    """The host-to-device copies' bytes inside [lo, hi), a copy that straddles an edge counted by its share of time."""
    n = 0.0
    for e in events:
        if e["kind"] == "copy" and e.get("h2d", True) and e.get("bytes", 0):
            a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            if b > a:
                n += e["bytes"] * (b - a) / max(e["dur"], 1e-9)
    return n


def layer_stretches(events: list[dict], lo: float, hi: float) -> list[dict]:
    """A token [lo, hi) cut at its expert kernels: for each, the stretch before it (from the previous expert kernel's
    end, or the token's start: the dense layers, the router, the host's decision) and the kernel itself, each with the
    bus's idle time in it and its host-to-device copies (busy µs and bytes); the last entry is the tail after the last
    expert kernel (the head, the sampled token). `first_copy`: µs from the stretch's start to its first staging copy.
    µs."""
    ks = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                if e["kind"] == "kernel" and is_expert(e["name"]) and lo <= e["ts"] < hi)
    out, at = [], lo
    for s0, e0 in ks + [(hi, hi)]:
        end = max(s0, at)
        d = token_split(events, at, end)
        k = token_split(events, s0, min(e0, hi)) if e0 > s0 else None
        starts = [e["ts"] for e in events if is_staging(e) and e.get("bytes", 0) >= 1 << 16 and at <= e["ts"] < end]
        out.append(dict(before=d["wall"], before_bus_idle=d["bus_idle"], before_copies=d["copies"],
                        before_copy_bytes=copy_bytes(events, at, end),
                        first_copy=(min(starts) - at) if starts else end - at,
                        kernel=k["wall"] if k else 0.0, kernel_copies=k["copies"] if k else 0.0,
                        kernel_copy_bytes=copy_bytes(events, s0, min(e0, hi)) if k else 0.0))
        at = max(at, min(e0, hi))
    return out


def raw_token(events: list[dict], lo: float, hi: float) -> list[list]:
    """One token's device events, [kind, name (48 characters), µs from the token's start, µs long, bytes], in order:
    the copies' sizes and gaps that the split above sums away."""
    return [[e["kind"], e["name"][:48], round(e["ts"] - lo, 2), round(e["dur"], 2), e.get("bytes", 0)]
            for e in sorted(events, key=lambda e: e["ts"]) if lo <= e["ts"] < hi]


def mean_split(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def main(argv=None) -> dict:
    import torch
    from bench.prefill_timeline import device_events
    from bench.workdir import ram_bench_args, ram_engine, warm_decode
    from gpu_worker.generate import greedy_steps, token_reader
    a = ram_bench_args(argv, __doc__.split("\n")[0], 12, "decode_timeline.json")
    store, engine = ram_engine(a.work, a.moe_layers)
    with engine as eng:
        st, tok = warm_decode(eng, 64, 8)
        logits = eng.step(tok, st)
        torch.cuda.synchronize()
        t = time.perf_counter()
        toks = greedy_steps(eng, logits, st, a.tokens)   # generate()'s loop (each step begun before the read)
        torch.cuda.synchronize()
        wall_noprof = (time.perf_counter() - t) * 1e3 / a.tokens
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        _ranged_parts(eng)
        nxt = eng.step(toks[-1], st)[-1].argmax()        # the greedy continuation: its last token fed
        with torch.profiler.profile(activities=acts) as prof:
            read = token_reader(nxt)
            eng.step_ahead(nxt, st)
            tok = read()
            for _ in range(a.tokens):      # greedy_steps' loop, a range from one read token to the next
                with torch.profiler.record_function("token"):
                    nxt = eng.step(tok, st)[-1].argmax()
                    read = token_reader(nxt)
                    eng.step_ahead(nxt, st)          # the next token's first stretch, before the read
                    with torch.profiler.record_function("token_sync"):
                        tok = read()
            eng.step(tok, st)
            torch.cuda.synchronize()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            trace = json.loads(Path(path).read_text())
        finally:
            os.unlink(path)
    events, _, _ = device_events(trace)
    tokens = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in trace.get("traceEvents", [])
                    if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == "token")
    rows = [token_split(events, lo, hi) for lo, hi in tokens]
    mean = mean_split(rows)
    layers = [layer_stretches(events, lo, hi) for lo, hi in tokens]
    n_layers = min((len(x) for x in layers), default=0)          # a token cut short by the profiler: fewer entries
    by_layer = [mean_split([x[i] for x in layers]) for i in range(n_layers)]
    names: dict = {}
    for e in events:
        if e["kind"] == "kernel":
            d = names.setdefault(e["name"][:60], [0, 0.0])
            d[0] += 1
            d[1] += e["dur"]
    top = sorted(([n, c / max(len(rows), 1), us / max(len(rows), 1)] for n, (c, us) in names.items()),
                 key=lambda r: -r[2])[:15]
    host = host_us_per_token(trace, tokens)
    mid = sorted(range(len(rows)), key=lambda i: rows[i]["wall"])[len(rows) // 2] if rows else None
    res = dict(moe_layers=len(store.moe_layers), tokens=len(rows), wall_ms_noprof=wall_noprof,
               mean_us=mean, per_token=rows, by_layer_us=by_layer, kernels_per_token_top=top, host_us_per_token=host,
               raw_median_token=raw_token(events, *tokens[mid]) if mid is not None else [])
    Path(a.out).write_text(json.dumps(res, indent=1))
    ms = lambda us: f"{us / 1e3:.3f}"      # noqa: E731
    print(f"decode, RAM regime, {len(store.moe_layers)} MoE layers: {wall_noprof:.3f} ms/token without the profiler, "
          f"{ms(mean.get('wall', 0))} with it ({len(rows)} tokens)")
    print("ms a token | wall | both | bus only | dense only | neither | expert kernels | H2D copies (beside experts) "
          "| bus idle")
    print(" | ".join([""] + [ms(mean.get(k, 0)) for k in ("wall",) + KINDS + ("expert_kernels",)])
          + f" | {ms(mean.get('copies', 0))} ({ms(mean.get('copies_beside_experts', 0))}) | "
          f"{ms(mean.get('bus_idle', 0))}")
    print("by MoE layer, ms a token | stretch before its experts | bus idle in it | copies in it (MB, GB/s busy, "
          "first after) | expert kernel | copies beside it (MB, GB/s busy)")
    rate = lambda b, us: f"{b / max(us, 1e-9) / 1e3:.1f}"      # noqa: E731
    for i, r in enumerate(by_layer):
        name = f"MoE {i}" if i < len(by_layer) - 1 else "tail (head, sampling)"
        print(f"  {name} | {ms(r['before'])} | {ms(r['before_bus_idle'])} | {ms(r['before_copies'])} "
              f"({r['before_copy_bytes'] / 1e6:.1f}, {rate(r['before_copy_bytes'], r['before_copies'])}, "
              f"{ms(r['first_copy'])}) | {ms(r['kernel'])} | {ms(r['kernel_copies'])} "
              f"({r['kernel_copy_bytes'] / 1e6:.1f}, {rate(r['kernel_copy_bytes'], r['kernel_copies'])})")
    print("host µs a token (profiled): " + ", ".join(f"{n} {us:.0f}" for n, us in host.items()))
    print("kernels a token, by device time (name | launches | µs):")
    for n, c, us in top:
        print(f"  {n} | {c:.1f} | {us:.1f}")
    return res


if __name__ == "__main__":
    main()
