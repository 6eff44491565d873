"""The reuse policy (prefetcher/policy.py ReusePolicy): it learns from the layer message which experts come back —
the guess, the layer, recency and frequency — and each behaviour is checked against a twin that lacks it (LRU, or
the same policy with that feature or its admission off)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from bench.policy_sim import simulate, synthetic_trace
from bench.policy_trace import Trace
from prefetcher.policy import LRUPolicy, ReusePolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache_shm"))
from moestream_fake_store import make_fake_store  # noqa: E402


def trained_on_good_guesses(**kw):
    """One layer of 8; every turn the guess names the expert used at the next turn (1, 2, 3, ... in turn)."""
    p = ReusePolicy(1, 8, **kw)
    for t in range(200):
        p.observe(0, [t % 8], 0, [(t + 1) % 8])
    return p


def test_a_guessed_expert_outlives_a_more_recent_one():
    """Experts 3 and 4 resident, 3 the older; the guess names 3 for the next turn. LRU evicts 3, the reuse policy
    4; its twin without the guess feature knows nothing of it and evicts 3 like LRU."""
    for p, want in ((trained_on_good_guesses(), 4), (trained_on_good_guesses(features="layer,age,freq"), 3),
                    (LRUPolicy(1, 8), 3)):
        p.insert(3, 3)
        p.insert(4, 4)
        if hasattr(p, "observe"):
            p.observe(0, [7], 0, [3])
        assert p.choose_victim(lambda s: True) == want, (type(p).__name__, getattr(p, "features", ""))


def test_admission_refuses_a_guess_no_better_than_chance():
    """Two layers: layer 0's guess for layer 1 is always right, layer 1's guess for the next token's layer 0 never
    (like the instrument's last layer). A resident used every turn is not given up for the hopeless guess, a
    resident never used is for the good one; with admission off (the twin) the hopeless guess is read too."""
    def train(**kw):
        p = ReusePolicy(2, 8, **kw)
        for t in range(300):
            p.observe(0, [0, 1], 1, [2])
            p.observe(1, [2, 3], 0, [6 + t % 2])
        p.insert(0, 0)                       # slot 0: layer 0's expert 0, used every turn
        p.insert(4, 4)                       # slot 4: layer 0's expert 4, never used
        return p
    p = train()
    assert p.reuse_probability([0])[0] > 0.9 and p.reuse_probability([7])[0] < 0.05
    assert not p.admit(7, 0)                 # layer 0, expert 7: layer 1 guessed it now, and it never comes
    p.observe(0, [0, 1], 1, [2])
    assert p.reuse_probability([8 + 2])[0] > 0.9 and p.admit(8 + 2, 4)
    assert train(admission=False).admit(7, 0)


def test_with_no_features_it_is_lru():
    """The twin with nothing to learn from ranks every resident alike and falls back to its ties, the least recent:
    the same hits and reads as LRU, demand and with the guess prefetch."""
    t = synthetic_trace(n_layers=3, n_experts=16, top_k=3, tokens=60, skew=0.5, seed=3)
    for pf in (False, True):
        for cap in (6, 12, 20):
            a, b = simulate(t, cap, "lru", pf), simulate(t, cap, "reuse", pf, features="")
            assert (a.hits, a.demand_reads, a.prefetch_reads) == (b.hits, b.demand_reads, b.prefetch_reads)


def skewed_trace(tokens=400, seed=0):
    """Layer 0 routes among 3 of 16 experts, layer 1 anywhere; the guess for the next layer is right."""
    rng = np.random.default_rng(seed)
    choice = [[tuple(rng.choice(3, 2, replace=False)) if j == 0 else tuple(rng.choice(16, 2, replace=False))
               for j in range(2)] for _ in range(tokens)]
    steps = []
    for t in range(tokens):
        for j in range(2):
            nxt = choice[t][1] if j == 0 else (choice[t + 1][0] if t + 1 < tokens else ())
            steps.append((j, choice[t][j], nxt))
    return Trace(steps, 2, 16, tokens)


def test_the_skewed_layer_gets_the_slots():
    """One ranking over both layers keeps layer 0's three experts resident: more hits than LRU, whose order mixes
    the layers; the twin without frequency and layer features gains less."""
    t = skewed_trace()
    lru, reuse = simulate(t, 6, "lru"), simulate(t, 6, "reuse")
    blind = simulate(t, 6, "reuse", features="age")
    assert reuse.hits > blind.hits >= lru.hits - 5 and reuse.hits > lru.hits + 100, (reuse.hits, blind.hits, lru.hits)


def test_the_prefetcher_refuses_a_hopeless_read_ahead(tmp_path):
    """In the prefetcher itself: with `reuse` a guess that never comes true stops being read once the cache is full
    of experts used every turn (counted as refused); with `lru` (the twin) every such guess is read."""
    import prefetcher.core as core
    from cache_shm.client import CacheClient
    from cache_shm.shm import CacheShm
    from tests.prefetcher.test_prefetch_policy import serve_all

    def run(policy):
        store = make_fake_store(tmp_path / policy, n_layers=2, n_experts=8)
        shm = CacheShm.create(store, n_slots=4, n_workers=1, prefetch_depth=4)
        try:
            pf, c = core.Prefetcher(shm, policy), CacheClient(shm)
            for _ in range(40):
                c.request(0, [0, 1], guess=[5 + _ % 3])      # layer 1 never uses 5, 6, 7
                pf.step()
                serve_all(shm, pf)
                c.request(1, [0, 1], guess=[])
                pf.step()
                serve_all(shm, pf)
            return c.stats()
        finally:
            shm.close()
    reuse, lru = run("reuse"), run("lru")
    assert reuse["prefetch_refused"] >= 30 and reuse["prefetch_issued"] <= 10, reuse
    assert lru["prefetch_refused"] == 0 and lru["prefetch_issued"] == 40, lru


def test_the_prefetcher_learns_after_the_demand_reads_and_before_the_reads_ahead(tmp_path):
    """ReusePolicy.observe (~0.1 ms a message at Super's scale) runs once the message's demand reads are on the
    IO workers' rings and before its reads ahead are admitted (their admission needs the guess it learns). The twin:
    a step that observes on arrival is caught by the same check."""
    import prefetcher.core as core
    from cache_shm.client import CacheClient
    from cache_shm.shm import CacheShm

    events = []

    class Spy(ReusePolicy):
        def observe(self, *a):
            events.append(("observe", len(shm.demand_rings[0]), len(shm.prefetch_rings[0])))
            return super().observe(*a)

    def run(on_arrival: bool):
        nonlocal shm
        events.clear()
        store = make_fake_store(tmp_path / str(on_arrival), n_layers=2, n_experts=8)
        shm = CacheShm.create(store, n_slots=6, n_workers=1, prefetch_depth=4)
        try:
            pf, c = core.Prefetcher(shm, "lru"), CacheClient(shm)
            pf.policy = Spy(2, 8)
            pf._observe, pf._admit = pf.policy.observe, pf.policy.admit
            if on_arrival:               # the twin: the old order
                real = pf._on_message

                def eager(msg):
                    real(msg)
                    for m in pf._to_observe:
                        pf._observe(*m)
                    pf._to_observe.clear()
                pf._on_message = eager
            c.request(0, [0, 1, 2], guess=[3, 4])
            pf.step()
            return list(events), len(shm.demand_rings[0]), len(shm.prefetch_rings[0])
        finally:
            shm.close()
    shm = None
    seen, demand, ahead = run(False)
    assert seen == [("observe", 3, 0)] and demand == 3 and ahead == 2, (seen, demand, ahead)
    seen, _, _ = run(True)
    assert seen == [("observe", 0, 0)], seen
