"""Chat turns in one process, as the server's compute process runs them: where bench.api_ttft's 126-token turn loses
against bench.prefill's 128-token prompt (H200 session 9: 152 ms of engine prefill in the server, 78 ms in
bench.prefill; the server's first turns of new lengths 143-191 ms, a length seen before 86 ms).

    python -m bench.prefill_turns --work DIR [--moe-layers 4] [--lengths 123,126,127,124,126] [--rounds 2]
                                  [--capture 5] [--modes off,drop,cut,keep] [--budget-mb 0] [--profile]
                                  [--out F.json]

The engine of bench.prefill's RAM regime (every expert cached), warmed as bench.api_ttft warms its server (two
4,000-token turns), then turns through `gpu_worker.generate` (prefill, the first token sampled on the device, one
decode step: max_tokens 2): `--rounds` rounds over `--lengths`, a new text window every turn, so round 1 is the
first visit of each length in the process and round 2 the second. Each turn's prefill is timed to its synchronized
end, beside the engine's own accounting. `--capture K` takes a snapshot K tokens before each prompt's end, as the
server does with cache_prompt on (the state captured inside the one prefill, kept on the host). `--modes` runs each
length once per mode, interleaved in one process (the order rotated per turn), for an A/B that the API bench's five
turns per server cannot resolve: `off` (no capture), `drop` (captured, then dropped), `cut` (`drop` with the Mamba
pieces cut at the snapshot point, MOESTREAM_CAPTURE_CUT=1: the way until session 10), `keep` (as the server with
cache_prompt on: a SnapshotStore looked up before the turn, the captured state kept with `put_host`, the end state
with `put`; session 10 also ran `settle`, the snapshot store moving kept states into pageable memory on its own
thread: +15-25 ms, removed). `--budget-mb`:
the prefill budget (0: the engine's default, as bench.api_ttft's server without --vram-gb). `--profile`: the first
turn of round 1 and of round 2 under torch.profiler, the top host ops by self CPU time and the top device
kernels, so that a first visit's extra time is read, not guessed. Each turn lists the Triton kernels it compiled
(or loaded from the disk cache) and how long that took.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


class Compiles:
    """Triton compiles (and loads from its disk cache) while it is on: (kernel, seconds), by patching
    JITFunction._do_compile, the method every cache miss of a kernel's in-process table goes through."""

    def __init__(self):
        self.seen: list[tuple[str, float]] = []
        self._orig = None

    def __enter__(self):
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return self
        if not hasattr(JITFunction, "_do_compile"):
            return self
        self._orig, seen = JITFunction._do_compile, self.seen
        orig = self._orig

        def timed(fn, *a, **kw):
            t = time.perf_counter()
            try:
                return orig(fn, *a, **kw)
            finally:
                seen.append((getattr(fn, "__name__", str(fn)), time.perf_counter() - t))
        JITFunction._do_compile = timed
        return self

    def take(self) -> list:
        out, self.seen[:] = list(self.seen), []
        return [(n, round(s * 1e3, 1)) for n, s in out]

    def __exit__(self, *exc):
        if self._orig is not None:
            from triton.runtime.jit import JITFunction
            JITFunction._do_compile = self._orig


MODES = ("off", "drop", "cut", "keep")


def one_turn(eng, ids, budget, capture: int, store=None) -> dict:
    """One turn; with `store` (a SnapshotStore) as the server's compute process runs a cache_prompt turn
    (gpu_worker/worker.py): a lookup first, the captured state kept with put_host, the end state with put."""
    from gpu_worker.generate import generate
    from procs.messages import SamplingParams
    kept = {}
    kw = {}
    if capture:
        on = ((lambda k, d: store.put_host(ids[:k], d)) if store is not None
              else (lambda k, d: kept.__setitem__(k, d)))
        kw = dict(capture_at=[len(ids) - capture], on_capture=on)
    torch.cuda.synchronize()
    t = time.perf_counter()
    restored = store.lookup(ids) if store is not None else None
    state = restored.state if restored is not None else eng.model.new_state()
    pos = restored.n_tokens if restored is not None else 0
    if restored is not None and capture:
        kw["capture_at"] = [k - pos for k in kw["capture_at"] if k > pos]
        on0 = kw["on_capture"]
        kw["on_capture"] = lambda k, d: on0(pos + k, d)
    it = generate(eng, ids[pos:], SamplingParams(max_tokens=2), state=state, prefill_budget=budget,
                  context_ids=ids, **kw)
    first = next(it)
    t_first = time.perf_counter() - t
    out = [first.token] + [s.token for s in it]
    torch.cuda.synchronize()
    if store is not None:
        store.put((list(ids) + out)[:state.position], state)
    last = eng.experts.prefill_acct.last
    return dict(tokens=len(ids), first_ms=t_first * 1e3, turn_ms=(time.perf_counter() - t) * 1e3,
                engine_prefill_ms=last.seconds * 1e3, cached=pos,
                launches=last.launches, first_token=first.token,
                captured=sorted(kept) if store is None else (store.stats["hits_ram"], len(store.ram)))


def mode_args(mode: str, capture: int, stores: dict):
    """(capture, store) of a turn in `mode`."""
    if mode == "off":
        return 0, None
    return capture, stores.get(mode)


def profile_turn(eng, ids, budget, capture, top=14, store=None) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = one_turn(eng, ids, budget, capture, store)
    ev = prof.key_averages()
    host = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    dev = sorted(ev, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:top]
    r["host_top"] = [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in host]
    r["device_top"] = [(e.key, e.count, round(getattr(e, "self_device_time_total", 0) / 1e3, 2)) for e in dev]
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--lengths", default="123,126,127,124,126")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--capture", type=int, default=0)
    ap.add_argument("--modes", default="", help=f"comma list of {', '.join(MODES)} (default: drop with --capture, "
                    "else off); `--capture` is the snapshot point of the capturing modes (default 5 with --modes)")
    ap.add_argument("--budget-mb", type=int, default=0)
    ap.add_argument("--warm-tokens", type=int, default=4000)
    ap.add_argument("--io-workers", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="prefill_turns.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill_turns times the CUDA engine: no CUDA device here")
    from tokenizers import Tokenizer

    from bench.peers import texts
    from bench.prefill import text_ids
    from bench.workdir import all_experts_bytes, super_store, warm_all
    from gpu_worker.engine import StreamingEngine
    from nemotron.config import NemotronHConfig
    model_dir, store_dir, store = super_store(a.work, a.moe_layers)
    vocab = NemotronHConfig.from_dir(model_dir).vocab_size
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    corpus = texts.load_text()
    lengths = [int(n) for n in a.lengths.split(",") if n]
    budget = (a.budget_mb << 20) or None
    modes = [m.strip() for m in a.modes.split(",") if m.strip()] or (["drop"] if a.capture else ["off"])
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: {bad} not among {MODES}")
    capture = a.capture or (5 if a.modes else 0)
    res = dict(moe_layers=len(store.moe_layers), device=torch.cuda.get_device_name(), lengths=lengths,
               capture=capture, modes=modes, budget_mb=a.budget_mb, turns=[])
    with StreamingEngine(store_dir, cache_bytes=all_experts_bytes(store),
                         io_workers=a.io_workers, device="cuda", dtype=torch.bfloat16) as eng, Compiles() as comp:
        from gpu_worker.snapshots import SnapshotStore
        stores = {m: SnapshotStore("bench", eng.model.new_state, "cuda") for m in modes if m == "keep"}
        warm_all(eng, store)
        for i in range(2):          # as bench.api_ttft warms its server
            one_turn(eng, text_ids(tok, corpus, vocab, a.warm_tokens, 900 + i), budget, 0)
        res["warm_compiles"] = comp.take()
        seed = 5000
        for rnd in range(1, a.rounds + 1):
            for i, n in enumerate(lengths):
                for j in range(len(modes)):
                    mode = modes[(i + j) % len(modes)]          # rotated: no mode always runs first
                    seed += 1
                    ids = text_ids(tok, corpus, vocab, n, seed)
                    cap, st = mode_args(mode, capture, stores)
                    if mode == "cut":       # the Mamba pieces cut at the snapshot point (the way before session 10)
                        os.environ["MOESTREAM_CAPTURE_CUT"] = "1"
                    else:
                        os.environ.pop("MOESTREAM_CAPTURE_CUT", None)
                    if a.profile and i == 0 and (len(modes) == 1 or rnd == a.rounds):
                        r = profile_turn(eng, ids, budget, cap, store=st)
                    else:
                        r = one_turn(eng, ids, budget, cap, st)
                    if st is not None:
                        st.settled(5.0)         # the server's next turn comes after the client's round trip
                    r["round"], r["mode"], r["compiles"] = rnd, mode, comp.take()
                    res["turns"].append(r)
                    print(json.dumps({k: v for k, v in r.items() if not k.endswith("_top")}), flush=True)
        os.environ.pop("MOESTREAM_CAPTURE_CUT", None)
        for st in stores.values():
            st.close()
    Path(a.out).write_text(json.dumps(res, indent=1))
    for r in res["turns"]:
        if "host_top" in r:
            print(f"round {r['round']}, {r['mode']}, {r['tokens']} tokens (profiled, {r['first_ms']:.1f} ms): "
                  "host ops by self CPU ms")
            for k, n, ms in r["host_top"]:
                print(f"  {ms:8.2f}  {n:6d}  {k[:90]}")
            print("  device kernels by self device ms")
            for k, n, ms in r["device_top"][:8]:
                print(f"  {ms:8.2f}  {n:6d}  {k[:90]}")
    print(f"capture {capture}, modes {','.join(modes)}, budget {a.budget_mb} MiB (0: default)")
    print("round | mode | tokens | first token ms | turn ms | launches | first token | Triton compiles (ms)")
    for r in res["turns"]:
        comps = ", ".join(f"{n} {ms:.0f}" for n, ms in r["compiles"][:6])
        print(f"{r['round']} | {r['mode']} | {r['tokens']} | {r['first_ms']:.1f} | {r['turn_ms']:.1f} | "
              f"{r['launches']} | {r['first_token']} | {comps or '-'}")
    if len(modes) > 1:      # the A/B: medians of the turns not profiled, the last round (the first visits' compiles
        import statistics  # fall in round 1)
        print("mode | turns | median first token ms (last round) | median (all rounds) | min")
        for m in modes:
            last = [r["first_ms"] for r in res["turns"] if r["mode"] == m and r["round"] == a.rounds
                    and "host_top" not in r]
            every = [r["first_ms"] for r in res["turns"] if r["mode"] == m and "host_top" not in r]
            if every:
                print(f"{m} | {len(every)} | {statistics.median(last) if last else float('nan'):.1f} | "
                      f"{statistics.median(every):.1f} | {min(every):.1f}")


if __name__ == "__main__":
    main()
