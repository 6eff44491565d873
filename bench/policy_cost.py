"""Host cost of the cache policies at Super's scale, on a synthetic routing stream.

    python -m bench.policy_cost [--tokens 200 --slots 6000 --layers 40 --experts 512 --top-k 22]

Super (Nemotron 3 Super): 40 MoE layers x 512 experts = 20,480 experts; a 20 GB cache of ~3 MB blocks holds
~6,000-7,000 of them. The stream is bench.policy_trace.synthetic_trace (per-layer Zipf-like popularity with a
drifting hot set, top-k actual + a guess of k for the next layer right with p = 0.7), replayed with the guess prefetch
through bench.policy_sim.simulate with the policy's methods timed: us per expert lookup (all the policy's bookkeeping,
as policy_sim --host-cost, which also counts the replay's own Python), us per eviction (choose_victim) and per layer
message (observe). Warm-up tokens first (the cache fills), then the timed ones.
"""
from __future__ import annotations

import argparse
import time

from bench.policy_sim import simulate
from bench.policy_trace import Trace, synthetic_trace
from prefetcher import policy as P


def timed_policy(cls):
    """A subclass of `cls` that adds up the seconds spent in choose_victim and observe, and their calls."""
    class Timed(cls):
        t = {"choose_victim": [0.0, 0], "observe": [0.0, 0], "all": [0.0, 0]}

        def _time(self, name, fn, *a):
            t0 = time.perf_counter()
            out = fn(*a)
            dt = time.perf_counter() - t0
            self.t[name][0] += dt
            self.t[name][1] += 1
            return out

        def choose_victim(self, evictable):
            return self._time("choose_victim", super().choose_victim, evictable)

        if hasattr(cls, "observe"):
            def observe(self, *a):
                return self._time("observe", super().observe, *a)
    Timed.name = cls.name
    return Timed


def measure(trace: Trace, slots: int, name: str, warm_tokens: int) -> dict:
    cls = timed_policy(P.POLICIES[name])
    saved = P.POLICIES[name]
    P.POLICIES[name] = cls
    try:
        per_layer = trace.n_layers
        warm = Trace(trace.steps[:warm_tokens * per_layer], trace.n_layers, trace.n_experts, warm_tokens)
        t0 = time.perf_counter()
        rw = simulate(warm, slots, name, prefetch=True)
        tw = time.perf_counter() - t0
        for v in cls.t.values():
            v[:] = [0.0, 0]
        t0 = time.perf_counter()
        r = simulate(trace, slots, name, prefetch=True)
        tt = time.perf_counter() - t0
    finally:
        P.POLICIES[name] = saved
    # the timed part: the whole replay less its warm-up prefix (the same steps replayed cold first)
    dt, acc = tt - tw, r.accesses - rw.accesses
    cv, ob = cls.t["choose_victim"], cls.t["observe"]
    toks = trace.tokens - warm_tokens
    return {"policy": name, "us_per_lookup": dt / max(acc, 1) * 1e6, "ms_per_token": dt / max(toks, 1) * 1e3,
            "us_per_eviction": cv[0] / max(cv[1], 1) * 1e6, "evictions_per_token": cv[1] / trace.tokens,
            "us_per_observe": ob[0] / max(ob[1], 1) * 1e6, "hit_rate": r.hit_rate,
            "reads_per_token": r.reads_per_token, "refused_per_token": r.prefetch_refused / r.tokens}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=22)
    ap.add_argument("--slots", type=int, default=6000)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--warm", type=int, default=100, help="tokens replayed before the timed ones")
    ap.add_argument("--skew", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="lru,reuse")
    a = ap.parse_args(argv)
    trace = synthetic_trace(a.layers, a.experts, a.top_k, a.warm + a.tokens, a.skew, a.seed)
    print(f"{a.layers} x {a.experts} experts, {a.slots} slots, top-{a.top_k} + guess, {a.tokens} timed tokens "
          f"after {a.warm}")
    for name in a.policies.split(","):
        m = measure(trace, a.slots, name, a.warm)
        print(f"{name:<8} {m['us_per_lookup']:7.1f} us/lookup  {m['ms_per_token']:7.2f} ms/token  "
              f"evict {m['us_per_eviction']:7.1f} us x {m['evictions_per_token']:5.1f}/token  "
              f"observe {m['us_per_observe']:6.1f} us  hit {m['hit_rate'] * 100:5.1f} %  "
              f"reads {m['reads_per_token']:5.1f}/token  refused {m['refused_per_token']:4.1f}/token")


if __name__ == "__main__":
    main()
