"""Where a prompt's prefill wall time goes on the device's timeline: the copy engine and the compute stream side by
side, between the host's router syncs (one a MoE layer).

    python -m bench.prefill_timeline --work DIR [--moe-layers 4] [--sizes 4000,16000] [--budget-mb N] [--out OUT.json]

The RAM regime (every expert cached, weights staged, the engine's defaults), prompts of varied real text. Each size
runs once to compile, then once under torch.profiler (CUPTI: every kernel and every copy with its stream and its
device time). The prompt's wall on the device is cut into what ran at each instant:

  both      a host->device copy and a kernel at once (the overlap the pipeline is built for)
  copy      only copies: the compute stream waits for weights (a copy-bound stretch)
  compute   only kernels: the bus idles (the copies ahead ran out, or nothing was asked for yet)
  neither   the device idles: the host is issuing work, or waiting (its router sync, the disk)

and the same split is given per stretch between consecutive router syncs (`MoE j` = from layer j's sync to the next
one; `pre` = the prompt's start to the first sync, the dense layers before the first MoE layer; `tail` = the last
sync to the end). The floor's view: the H2D bytes the prompt moved over the copy-busy time is the copies' own rate;
wall − max(copy busy, compute busy) is what a perfect overlap of the two would save.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

KINDS = ("both", "copy", "compute", "neither")


def union(iv):
    """Sorted, merged [start, end) intervals."""
    out = []
    for s, e in sorted(iv):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(x) for x in out]


def length(iv, lo=None, hi=None) -> float:
    """Total length of merged intervals `iv`, clipped to [lo, hi)."""
    t = 0.0
    for s, e in iv:
        if lo is not None:
            s = max(s, lo)
        if hi is not None:
            e = min(e, hi)
        t += max(0.0, e - s)
    return t


def intersect(a, b):
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def split(copies, kernels, lo: float, hi: float) -> dict:
    """{kind: time} over [lo, hi) of two merged interval lists (KINDS)."""
    c, k = length(copies, lo, hi), length(kernels, lo, hi)
    b = length(intersect(copies, kernels), lo, hi)
    return dict(both=b, copy=c - b, compute=k - b, neither=(hi - lo) - (c + k - b))


def timeline(events: list[dict], marks: list[float], lo: float, hi: float) -> dict:
    """events: the device's [{kind: 'copy'|'kernel', ts, dur, bytes}] (µs); marks: the host's sync times (µs) inside
    [lo, hi). Returns the whole prompt's split, its H2D bytes and busy times, and one split per stretch."""
    copies = union((e["ts"], e["ts"] + e["dur"]) for e in events if e["kind"] == "copy")
    kernels = union((e["ts"], e["ts"] + e["dur"]) for e in events if e["kind"] == "kernel")
    edges = [lo] + sorted(m for m in marks if lo < m < hi) + [hi]
    names = ["pre"] + [f"MoE {j}" for j in range(len(edges) - 2)]
    if len(names) > 1:
        names[-1] += " + tail"                          # the last MoE layer's stretch runs to the prompt's end
    stretches = []
    for i, name in enumerate(names):
        a, b = edges[i], edges[i + 1]
        stretches.append(dict(name=name, start=a - lo, wall=b - a, **split(copies, kernels, a, b)))
    h2d = sum(e.get("bytes", 0) for e in events if e["kind"] == "copy" and e.get("h2d", True))
    return dict(wall=hi - lo, copy_busy=length(copies, lo, hi), compute_busy=length(kernels, lo, hi),
                h2d_bytes=h2d, **split(copies, kernels, lo, hi), stretches=stretches)


def host_calls(trace: dict, lo: float, hi: float, top: int = 8) -> list[dict]:
    """The host's CUDA runtime and driver calls inside [lo, hi), by total time: where the host blocks (a stream or
    event synchronize, a pageable copy, a pinned allocation) shows as a call far longer than its ~µs of issue."""
    by: dict = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        t = float(e["ts"])
        if not lo <= t < hi:
            continue
        d = by.setdefault(e.get("name", "?"), dict(name=e.get("name", "?"), calls=0, us=0.0, longest_us=0.0))
        d["calls"] += 1
        d["us"] += float(e.get("dur", 0))
        d["longest_us"] = max(d["longest_us"], float(e.get("dur", 0)))
    return sorted(by.values(), key=lambda d: -d["us"])[:top]


def device_events(trace: dict) -> tuple[list[dict], list[float], tuple[float, float] | None]:
    """From a chrome trace (torch.profiler's export): the device's copies and kernels, the host's router-sync marks
    and the prompt's (start, end) on the host (record_function 'prompt')."""
    ev, marks, prompt = [], [], None
    for e in trace.get("traceEvents", []):
        cat, name = e.get("cat", ""), e.get("name", "")
        if e.get("ph") != "X":
            continue
        if cat in ("gpu_memcpy", "gpu_memset", "kernel"):
            is_copy = cat != "kernel"
            args = e.get("args", {})
            ev.append(dict(kind="copy" if is_copy else "kernel", ts=float(e["ts"]), dur=float(e.get("dur", 0)),
                           bytes=int(args.get("bytes", 0)) if is_copy else 0, h2d="HtoD" in name, name=name))
        elif cat != "user_annotation":                 # (the device's copy of a range is gpu_user_annotation)
            continue
        elif name == "moe_router_sync":
            marks.append(float(e["ts"]) + float(e.get("dur", 0)))
        elif name == "prompt":
            prompt = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
    return ev, marks, prompt


def show(n: int, r: dict) -> None:
    ms = lambda us: f"{us / 1e3:7.2f}"      # noqa: E731
    print(f"\n== {n} tokens: wall {r['wall'] / 1e3:.2f} ms; copy busy {r['copy_busy'] / 1e3:.2f} ms "
          f"({r['h2d_bytes'] / 1e9:.2f} GB H2D, {r['h2d_bytes'] / max(r['copy_busy'], 1e-9) / 1e3:.1f} GB/s while "
          f"busy), compute busy {r['compute_busy'] / 1e3:.2f} ms; a perfect overlap would save "
          f"{(r['wall'] - max(r['copy_busy'], r['compute_busy'])) / 1e3:.2f} ms")
    print("stretch | start ms | wall ms | both | copy only | compute only | neither")
    for s in r["stretches"] + [dict(name="prompt", start=0.0, **{k: r[k] for k in ("wall",) + KINDS})]:
        print(f"{s['name']} | {ms(s['start'])} | {ms(s['wall'])} | " + " | ".join(ms(s[k]) for k in KINDS))
    if r.get("host_calls"):
        print("host calls: " + "; ".join(f"{d['name']} {d['us'] / 1e3:.1f} ms / {d['calls']} (longest "
                                         f"{d['longest_us'] / 1e3:.2f})" for d in r["host_calls"]))


def ranged(fn, name: str):
    """fn inside a profiler range of its name (the host's side of the timeline)."""
    import torch

    def inner(*a, **kw):
        with torch.profiler.record_function(name):
            return fn(*a, **kw)
    return inner


RAW_RANGES = ("moe_router_sync", "_prefill_batch", "_copy_ahead", "_eager_copies", "_stage", "_flow_start",
              "flow_feed")


def raw_events(trace: dict, lo: float, hi: float) -> list[list]:
    """The prompt's device events and the host's ranges, compact: [what, stream or -1, start µs from the prompt's
    start, µs, bytes, name[:48]] — what: 'k' kernel, 'c' copy, 'h' a host range (RAW_RANGES)."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat, name, t = e.get("cat", ""), e.get("name", ""), float(e.get("ts", 0))
        if not lo <= t < hi:
            continue
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            args = e.get("args", {})
            out.append(["k" if cat == "kernel" else "c", int(args.get("stream", -1)), round(t - lo, 1),
                        round(float(e.get("dur", 0)), 1), int(args.get("bytes", 0)), name[:48]])
        elif cat == "user_annotation" and name in RAW_RANGES:
            out.append(["h", -1, round(t - lo, 1), round(float(e.get("dur", 0)), 1), 0, name])
    return sorted(out, key=lambda r: r[2])


def kernels_by_name(raw: list[list]) -> list[dict]:
    """The raw events' kernels summed by name, the longest first: [{name, launches, ms}]. Where a prompt's compute
    time goes, kernel by kernel (copies are not kernels; their streams' time is the timeline's copy columns)."""
    tot: dict[str, list] = {}
    for what, _, _, us, _, name in raw:
        if what == "k":
            t = tot.setdefault(name, [0, 0.0])
            t[0] += 1
            t[1] += us
    return sorted((dict(name=k, launches=n, ms=us / 1e3) for k, (n, us) in tot.items()), key=lambda d: -d["ms"])


def bus_gaps(raw: list[list], min_ms: float = 1.0) -> list[dict]:
    """The stretches of at least `min_ms` with no host-to-device copy on the bus, from the prompt's first H2D copy to
    its last event (the last one is the tail after the bus is done): each one's start and length, the kernels' busy
    time in it, and the host's ranges (RAW_RANGES) overlapping it, ms by name — what held the next copies back
    (session 25's reading of a 16k prompt: the launch loop's `_prefill_batch` ranges, ~15 ms a layer, before the next
    layer's `_copy_ahead`). raw: `raw_events`' rows."""
    h2d = union((s, s + d) for what, _, s, d, _, name in raw if what == "c" and "HtoD" in name)
    if not h2d:
        return []
    end = max(s + d for what, _, s, d, _, _ in raw if what in "kc")
    kernels = union((s, s + d) for what, _, s, d, _, _ in raw if what == "k")
    out = []
    for lo, hi in [(a[1], b[0]) for a, b in zip(h2d, h2d[1:])] + [(h2d[-1][1], end)]:
        if hi - lo < min_ms * 1e3:
            continue
        host: dict[str, float] = {}
        for what, _, s, d, _, name in raw:
            o = min(hi, s + d) - max(lo, s)
            if what == "h" and o > 0:
                host[name] = host.get(name, 0.0) + o / 1e3
        out.append(dict(start_ms=lo / 1e3, ms=(hi - lo) / 1e3, compute_ms=length(kernels, lo, hi) / 1e3,
                        tail=hi == end, host_ms=dict(sorted(host.items(), key=lambda kv: -kv[1]))))
    return out


def host_profile(fn, sync=None, top: int = 60, callers_of=()) -> tuple[list[dict], float]:
    """One call of fn under cProfile (then `sync`): the functions by their own time, [{function, calls, own_ms,
    cum_ms}] (at most `top`), and the whole call's ms. Where the host's time a prompt goes, Python line by line: the
    torch profiler's host ranges say which phase, this says which function. callers_of: substrings of function names
    whose rows also list who called them ({caller, calls, ms}: the time spent in the function from that caller)."""
    import cProfile
    import pstats
    import time as _time
    prof = cProfile.Profile()
    t = _time.perf_counter()
    prof.enable()
    fn()
    if sync is not None:
        sync()
    prof.disable()
    total = (_time.perf_counter() - t) * 1e3
    st = pstats.Stats(prof)
    rows = []
    label = (lambda f: f"{Path(f[0]).name}:{f[1]}({f[2]})")
    for f, (cc, nc, tt, ct, callers) in st.stats.items():
        row = dict(function=label(f), calls=int(nc), own_ms=tt * 1e3, cum_ms=ct * 1e3)
        if any(c and c in row["function"] for c in callers_of):
            row["callers"] = sorted((dict(caller=label(g), calls=int(v[1]), ms=v[3] * 1e3) for g, v in callers.items()),
                                    key=lambda c: -c["ms"])
        rows.append(row)
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top] + [r for r in rows[top:] if "callers" in r], total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--sizes", default="4000,16000")
    ap.add_argument("--env", default="none", help="comma list of settings to compare in one engine: 'none' or "
                    "KEY=VAL[+KEY=VAL...] (set while that row runs; read per prompt by the switch); gate=G: copies "
                    "ahead for prompts of G tokens and more (the engine's ahead_min_tokens)")
    ap.add_argument("--budget-mb", type=int, default=0,
                    help="each prompt under this prefill budget (the server's reserve: 512), as bench.prefill's budget "
                         "rows run it; 0: unbudgeted (the engine's default plan for an idle card)")
    ap.add_argument("--raw", action="store_true", help="keep every device event and the host's ranges in the JSON")
    ap.add_argument("--cprofile", default="", help="comma list of prompt sizes run once more under cProfile (the "
                    "engine's defaults): the host's Python by function")
    ap.add_argument("--cprofile-top", type=int, default=25)
    ap.add_argument("--cprofile-callers", default="acquire,<frozen os>,JITFunction.run,jit.py:695",
                    help="comma list of substrings: those functions' callers are printed too")
    ap.add_argument("--out", default="prefill_timeline.json")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill_timeline reads the device's timeline: no CUDA device here")
    from tokenizers import Tokenizer
    from bench.peers import texts
    from bench.prefill import text_ids
    from bench.workdir import all_experts_bytes, super_store, warm_all
    from gpu_worker.engine import StreamingEngine
    from gpu_worker.prefill import prefill
    model_dir, store_dir, store = super_store(a.work, a.moe_layers)
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    corpus = texts.load_text()
    res: dict = dict(moe_layers=len(store.moe_layers), device=torch.cuda.get_device_name(), rows=[],
                     budget_mb=a.budget_mb)
    budget = (a.budget_mb << 20) or None
    with StreamingEngine(store_dir, cache_bytes=all_experts_bytes(store), io_workers=8, device="cuda",
                         dtype=torch.bfloat16) as eng:
        warm_all(eng, store)
        src = eng.experts
        plain_sync = src._router_sync

        def marked_sync(counts, guess, overlap=None):   # the host's mark of each MoE layer's one sync
            with torch.profiler.record_function("moe_router_sync"):
                return plain_sync(counts, guess, overlap)
        src._router_sync = marked_sync
        for name in ("_prefill_batch", "_copy_ahead", "_eager_copies", "_stage", "_flow_start"):   # the host's ranges
            setattr(src, name, ranged(getattr(src, name), name))                                       # (--raw)
        from gpu_worker.ahead_flow import AheadFlow
        AheadFlow.feed = ranged(AheadFlow.feed, "flow_feed")     # (MOESTREAM_PREFILL_AHEAD_FLOW's copies)
        default_gate = src.ahead_min_tokens
        vocab = eng.model.config.vocab_size
        for n in [int(s) for s in a.sizes.split(",") if s]:
            for setting in a.env.split(","):
                env = dict(p.partition("=")[::2] for p in setting.split("+") if p != "none")
                gate = env.pop("gate", None)             # gate=G: copies ahead for prompts of G tokens and more
                old = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                if gate is not None:
                    src.ahead_min_tokens = int(gate)
                try:
                    prefill(eng.model, text_ids(tok, corpus, vocab, n, 7), eng.model.new_state(),   # compiles
                            budget_bytes=budget)
                    ids = text_ids(tok, corpus, vocab, n, 8)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    prefill(eng.model, ids, eng.model.new_state(), budget_bytes=budget)
                    torch.cuda.synchronize()
                    plain_ms = (time.perf_counter() - t) * 1e3
                    plain = dataclasses.asdict(src.prefill_acct.last)     # the host's figures without a profiler
                    ids = text_ids(tok, corpus, vocab, n, 9)
                    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                    with torch.profiler.profile(activities=acts) as prof:
                        with torch.profiler.record_function("prompt"):
                            prefill(eng.model, ids, eng.model.new_state(), budget_bytes=budget)
                            torch.cuda.synchronize()
                    with tempfile.TemporaryDirectory() as d:
                        p = os.path.join(d, "trace.json")
                        prof.export_chrome_trace(p)
                        trace = json.loads(Path(p).read_text())
                    pa = dataclasses.asdict(src.prefill_acct.last)
                finally:
                    src.ahead_min_tokens = default_gate
                    for k, v in old.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                ev, marks, prompt = device_events(trace)
                if prompt is None:
                    raise SystemExit("the profile holds no 'prompt' range")
                r = timeline(ev, marks, *prompt)
                r["host_calls"] = host_calls(trace, *prompt)
                if a.raw:
                    r["raw"] = raw_events(trace, *prompt)
                    r["kernels_by_name"] = kernels_by_name(r["raw"])
                    print(f"\n[{setting}] {n} tokens, the compute kernels by name (profiled pass): name | launches | ms")
                    for k in r["kernels_by_name"][:18]:
                        print(f"  {k['name']} | {k['launches']} | {k['ms']:.2f}")
                    r["bus_gaps"] = bus_gaps(r["raw"])
                    idle = sum(g["ms"] for g in r["bus_gaps"])
                    print(f"[{setting}] {n} tokens, the bus idle for 1 ms or more ({idle:.1f} ms in all; profiled): "
                          "start ms | ms | kernels busy ms | host ranges in it, ms")
                    for g in r["bus_gaps"]:
                        print(f"  {g['start_ms']:.1f}{' (tail)' if g['tail'] else ''} | {g['ms']:.1f} | "
                              f"{g['compute_ms']:.1f} | " + ", ".join(f"{k} {v:.1f}" for k, v in g["host_ms"].items()))
                r.update(tokens=n, setting=setting, wall_noprof_ms=plain_ms, syncs=len(marks), accounting=pa,
                         accounting_plain=plain)
                res["rows"].append(r)
                print(f"\n[{setting}] TTFT without the profiler {plain_ms:.1f} ms; routed {pa['distinct_experts']}, "
                      f"copied ahead {pa['ahead_copied']} (used {pa['ahead_used']}, wrong {pa['ahead_wrong']}), eager "
                      f"{pa.get('eager_copied', 0)}, launches {pa['launches']}, guess right {pa['guess_right']} of "
                      f"{pa['guess_named']} named / {pa['guess_layer_routed']} routed; host ms without the profiler: "
                      f"MoE steps {plain['ms_host_moe']:.1f}, launching {plain['ms_host_launching']:.1f} (staging "
                      f"{plain['ms_host_staging']:.1f}), ahead {plain['ms_issuing_ahead']:.1f}, router syncs "
                      f"{plain['ms_router_sync']:.1f}")
                show(n, r)
                Path(a.out).write_text(json.dumps(res, indent=1))
        for n in [int(s) for s in a.cprofile.split(",") if s]:      # the host's Python, by function
            ids = text_ids(tok, corpus, vocab, n, 10)
            rows, total_ms = host_profile(lambda: prefill(eng.model, ids, eng.model.new_state(), budget_bytes=budget),
                                          torch.cuda.synchronize, callers_of=a.cprofile_callers.split(","))
            res.setdefault("cprofile", []).append(dict(tokens=n, total_ms=total_ms, top=rows))
            print(f"\n== host Python, {n} tokens (cProfile, the device synchronized at the end): {total_ms:.1f} ms")
            print("function | calls | own ms | with callees ms")
            for f in rows[:a.cprofile_top]:
                print(f"{f['function']} | {f['calls']} | {f['own_ms']:.2f} | {f['cum_ms']:.2f}")
            for f in rows:
                if f.get("callers"):
                    print(f"  {f['function']} called from: " + "; ".join(
                        f"{c['caller']} {c['calls']} x {c['ms']:.2f} ms" for c in f["callers"][:6]))
            Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
