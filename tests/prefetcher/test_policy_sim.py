"""The cache policy simulator (bench/policy_sim.py): Belady's MIN is the optimum (checked against an exhaustive
search on tiny traces) and never loses to LRU or any other demand policy on any trace (property test); a
deliberately wrong "optimum" is caught by both; the replay of LRU matches a hand count; the LRFU policy;
the trace reader reads what the engine's RoutingRecorder writes."""
from __future__ import annotations

import functools

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.policy_sim import (Trace, belady, belady_prefetch, fitted_ranking, fitted_table, next_use_table,
                              read_trace, rotate, simulate, sweep, synthetic_trace, table)
from prefetcher.policy import DecayedFrequencyPolicy, make_policy

DEMAND_POLICIES = ("lru", "lfu", "lrfu", "slru", "arc", "reuse")


def stale_next_use(keys) -> np.ndarray:
    """The deliberately wrong optimum's table: each expert's next use as seen from its first use, never
    advanced (a table built once per expert instead of once per position)."""
    right = next_use_table(keys)
    first: dict[int, int] = {}
    for p, k in enumerate(keys):
        first.setdefault(k, int(right[p]))
    return np.array([first[k] for k in keys], dtype=np.int64)


def keys_of(trace):
    return [trace.key(j, e) for j, ex, _ in trace.steps for e in ex]


def optimum(keys, capacity) -> int:
    """Fewest misses of any demand policy, by exhaustive search over the victims (tiny traces only)."""
    @functools.lru_cache(maxsize=None)
    def best(p, cache):
        if p == len(keys):
            return 0
        k = keys[p]
        if k in cache:
            return best(p + 1, cache)
        if len(cache) < capacity:
            return 1 + best(p + 1, cache | {k})
        return 1 + min(best(p + 1, (cache - {v}) | {k}) for v in cache)
    return best(0, frozenset())


@st.composite
def traces(draw, max_tokens=25):
    n_layers = draw(st.integers(1, 3))
    n_experts = draw(st.integers(2, 10))
    top_k = draw(st.integers(1, min(3, n_experts)))
    tokens = draw(st.integers(1, max_tokens))
    hot = draw(st.integers(1, n_experts))        # concentrated routing sometimes, uniform other times
    steps = []
    for _ in range(tokens):
        for j in range(n_layers):
            ex = draw(st.lists(st.integers(0, hot - 1) if draw(st.booleans()) else st.integers(0, n_experts - 1),
                               min_size=top_k, max_size=top_k, unique=True)) if hot >= top_k else \
                draw(st.lists(st.integers(0, n_experts - 1), min_size=top_k, max_size=top_k, unique=True))
            guess = draw(st.lists(st.integers(0, n_experts - 1), max_size=top_k, unique=True))
            steps.append((j, tuple(ex), tuple(guess)))
    trace = Trace(steps, n_layers, n_experts, tokens)
    capacity = draw(st.integers(top_k, n_layers * n_experts))
    return trace, capacity


@settings(max_examples=200, deadline=None)
@given(traces())
def test_belady_never_loses_to_a_demand_policy(tc):
    trace, cap = tc
    b = belady(trace, cap)
    assert b.accesses == sum(len(ex) for _, ex, _ in trace.steps)
    for name in DEMAND_POLICIES:
        r = simulate(trace, cap, name)
        assert r.accesses == b.accesses
        assert b.demand_reads <= r.demand_reads, (name, b.demand_reads, r.demand_reads)
    f = fitted_ranking(trace, cap)
    assert f.accesses == b.accesses and b.demand_reads <= f.demand_reads


@settings(max_examples=150, deadline=None)
@given(traces(max_tokens=5))
def test_belady_is_the_optimum_on_tiny_traces(tc):
    trace, cap = tc
    keys = keys_of(trace)
    if len(set(keys)) > 7 or len(keys) > 16:
        return                     # keep the exhaustive search small
    assert belady(trace, cap).demand_reads == optimum(tuple(keys), cap)


def test_belady_never_loses_to_lru_on_seeded_synthetic_traces():
    for seed in range(12):
        t = synthetic_trace(n_layers=3, n_experts=12, top_k=3, tokens=40, skew=0.3 + 0.1 * seed, seed=seed)
        for cap in (3, 5, 9, 18, 36):
            assert belady(t, cap).demand_reads <= simulate(t, cap, "lru").demand_reads


def test_a_wrong_optimum_is_caught():
    """must-fail twin: Belady with a stale next-use table loses to LRU on some seeded trace, and is found
    non-optimal by the exhaustive search; the true one passes both on the same traces."""
    lost_to_lru = not_optimal = False
    for seed in range(40):
        t = synthetic_trace(n_layers=2, n_experts=8, top_k=2, tokens=30, skew=0.6, seed=seed)
        keys = keys_of(t)
        for cap in (3, 5, 8):
            wrong = belady(t, cap, next_use=stale_next_use(keys)).demand_reads
            lost_to_lru |= wrong > simulate(t, cap, "lru").demand_reads
            assert belady(t, cap).demand_reads <= simulate(t, cap, "lru").demand_reads
        small = Trace(t.steps[:6], 2, 8, 3)
        ks = keys_of(small)
        right = belady(small, 3).demand_reads
        assert right == optimum(tuple(ks), 3)
        not_optimal |= belady(small, 3, next_use=stale_next_use(ks)).demand_reads != right
    assert lost_to_lru and not_optimal


def test_lru_replay_matches_a_hand_count():
    # 2 slots, one expert a step: 0 1 2 0 1. LRU misses all five; MIN evicts 1 at 2 (used later than 0) and
    # misses four
    t = Trace([(0, (e,), ()) for e in (0, 1, 2, 0, 1)], 1, 3, 5)
    r = simulate(t, 2, "lru")
    assert (r.hits, r.demand_reads) == (0, 5)
    assert (belady(t, 2).hits, belady(t, 2).demand_reads) == (1, 4)
    # the experts of the step being served are pinned: 0 1 | 0 2 | 1 0 -> at the third step LRU's oldest is 0,
    # which the step uses, so 2 goes
    t = Trace([(0, (0, 1), ()), (0, (0, 2), ()), (0, (1, 0), ())], 1, 3, 3)
    r = simulate(t, 2, "lru")
    assert (r.hits, r.demand_reads) == (2, 4)
    # with prefetch: the guess for the next layer (the same layer here) is read ahead and counted
    t = Trace([(0, (0,), (1,)), (0, (1,), (2,)), (0, (0,), ())], 1, 3, 3)
    r = simulate(t, 2, "lru", prefetch=True)
    assert (r.hits, r.demand_reads, r.prefetch_reads, r.prefetch_used, r.prefetch_wasted) == (1, 2, 2, 1, 1)


def test_capacity_below_one_layer_is_a_clear_error():
    t = Trace([(0, (0, 1, 2), ())], 1, 3, 1)
    with pytest.raises(ValueError, match="cannot hold one layer's 3"):
        simulate(t, 2, "lru")
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(t, 3, "fifo")


def test_lrfu_keeps_the_frequent_expert_and_decays():
    p = DecayedFrequencyPolicy(1, 8, half_life=4.0)
    for s in range(3):
        p.insert(s, s)
    for _ in range(3):
        p.touch(0, 0)
    assert p.choose_victim(lambda s: True) == 1             # LRU would say 1 too; now make 0 the oldest
    p.touch(1, 1), p.touch(2, 2)
    assert p.choose_victim(lambda s: True) == 1             # 0's four uses outweigh 1's two, recent or not
    for _ in range(20):                                     # a long time later 0's count has decayed away
        p.touch(1, 1), p.touch(2, 2)
    assert p.choose_victim(lambda s: True) == 0
    p.demote(2)
    assert p.choose_victim(lambda s: True) == 2 and p.choose_victim(lambda s: s != 2) == 0
    p.remove(0)
    assert 0 not in p and p.choose_victim(lambda s: s != 2) == 1
    assert make_policy("lrfu", 1, 8).name == "lrfu"


def test_trace_reader_reads_the_recorder_format(tmp_path):
    from gpu_worker.streaming import RoutingRecorder
    path = tmp_path / "t.msgpack"
    rec = RoutingRecorder(path)
    for tok in range(3):
        for j in range(2):
            rec(j, tok, [j, j + 1], [j + 2], [j])
    rec.close()
    t = read_trace([path, path], n_experts=4)
    assert (t.n_layers, t.n_experts, t.tokens, len(t.steps)) == (2, 4, 6, 12)
    assert t.steps[1] == (1, (1, 2), (3,))
    with pytest.raises(ValueError, match="--n-experts is 3"):
        read_trace(path, n_experts=3)
    path.write_bytes(msgpack.packb((0, 1, [2])))
    with pytest.raises(ValueError, match="is not"):
        read_trace(path)


def test_sweep_table_has_every_policy_and_the_bound():
    t = synthetic_trace(n_layers=2, n_experts=16, top_k=2, tokens=30, skew=0.8, seed=1)
    rows = sweep(t, [0.1, 0.5])
    assert {r["policy"] for r in rows} == {"belady", "lru", "lfu", "lrfu", "slru", "arc", "reuse"} and len(rows) == 26
    text = table(rows)
    assert "lru+prefetch" in text and "gap closed" in text and "wasted" in text and "points over" in text
    rows = sweep(t, [0.1, 0.5], references=True)
    assert len(rows) == 30 and {(r["policy"], r["prefetch"]) for r in rows} >= {("belady", True), ("fitted", False)}
    assert "belady+prefetch" in table(rows)


def test_belady_prefetch_hand_count():
    # 2 slots, one layer. Step 0 reads 0 and reads 1 ahead; step 1 hits 1, reads 2 ahead in place of 0 (1 is
    # the step's); step 2 hits 2, reads 0 ahead in place of 1 (never used again); step 3 hits 0.
    t = Trace([(0, (0,), (1,)), (0, (1,), (2,)), (0, (2,), (0,)), (0, (0,), ())], 1, 3, 4)
    r = belady_prefetch(t, 2)
    assert (r.hits, r.demand_reads, r.prefetch_reads, r.prefetch_used, r.prefetch_wasted) == (3, 1, 3, 3, 0)
    # a wrong guess is read ahead, then evicted unused for the demand read of 1 (used again never): wasted
    t = Trace([(0, (0,), (2,)), (0, (1,), ()), (0, (0,), ())], 1, 3, 3)
    r = belady_prefetch(t, 2)
    assert (r.prefetch_reads, r.prefetch_wasted, r.hits, r.demand_reads) == (1, 1, 1, 2)
    assert belady_prefetch(t, 2, nearest=True).hits == 0          # the twin keeps 2 and evicts 0


def test_belady_prefetch_beats_lru_prefetch_on_seeded_traces():
    """Not a theorem (the reads ahead are fixed by the guess), but evicting by the future should not lose to
    LRU with the same reads ahead on ordinary traces; the twin that evicts the soonest used does."""
    wins = twin_losses = 0
    for seed in range(6):
        t = synthetic_trace(n_layers=3, n_experts=16, top_k=2, tokens=60, skew=0.5, seed=seed)
        for cap in (8, 16):          # (at 4 slots the step and its reads ahead fill the cache: no choice)
            b, lru = belady_prefetch(t, cap), simulate(t, cap, "lru", prefetch=True)
            assert b.hits >= lru.hits, (seed, cap, b.hits, lru.hits)
            wins += b.hits > lru.hits
            twin_losses += belady_prefetch(t, cap, nearest=True).hits < lru.hits
    assert wins == 12 and twin_losses == 12


def test_fitted_ranking_beats_lru_and_its_twin_does_not():
    better = twin_worse = 0
    for seed in range(6):
        t = synthetic_trace(n_layers=3, n_experts=24, top_k=3, tokens=120, skew=0.3, seed=seed)
        for cap in (12, 18, 24):
            lru = simulate(t, cap, "lru").hits
            better += fitted_ranking(t, cap).hits > lru
            twin_worse += fitted_ranking(t, cap, prob=-fitted_table(t)).hits < lru
    assert better >= 15 and twin_worse >= 15


def test_rotate_interleaves_whole_tokens():
    steps = [(j, (t,), ()) for t in range(6) for j in range(2)]          # expert id = token, two layers
    t = Trace(steps, 2, 6, 6)
    r = rotate(t, users=2, chunk=2)
    assert [ex[0] for _, ex, _ in r.steps[::2]] == [0, 1, 3, 4, 2, 5]
    assert sorted(r.steps) == sorted(t.steps) and r.tokens == 6
    assert rotate(t, 1, 4).steps == t.steps
    with pytest.raises(ValueError, match="do not fit"):
        rotate(t, 7, 1)


def test_the_guess_cut_to_its_depth():
    """`guess_ranks`: the guess cut to its first R experts, as the engine's MOESTREAM_PREFETCH_GUESS_RANKS sends it. A
    hand count (one layer, 3 slots): step 0 reads 0 and, with the whole guess, 1 and 2 ahead; cut to 1, only 1. Step 1
    uses 2: a hit with the whole guess, a demand read when cut. The sweep's depth 0 is the demand-only replay and
    its full depth the whole guess's."""
    t = Trace([(0, (0,), (1, 2)), (0, (2,), ())], 1, 3, 2)
    whole = simulate(t, 3, "lru", prefetch=True)
    cut = simulate(t, 3, "lru", prefetch=True, guess_ranks=1)
    assert (whole.prefetch_reads, whole.hits, whole.demand_reads, whole.prefetch_wasted) == (2, 1, 1, 1)
    assert (cut.prefetch_reads, cut.hits, cut.demand_reads, cut.prefetch_wasted) == (1, 0, 2, 1)
    from bench.policy_sim import guess_rank_sweep
    s = synthetic_trace(n_layers=2, n_experts=16, top_k=3, tokens=40, skew=0.8, seed=2, guess_accuracy=0.5)
    rows = {r["guess_ranks"]: r for r in guess_rank_sweep(s, 0.4, [0, 1, 3])}
    none, full = simulate(s, rows[0]["capacity"], "reuse"), simulate(s, rows[0]["capacity"], "reuse", prefetch=True)
    assert rows[0]["reads_per_token"] == none.reads_per_token and rows[0]["ahead_per_token"] == 0
    assert rows[3]["reads_per_token"] == full.reads_per_token
    assert rows[1]["ahead_per_token"] < rows[3]["ahead_per_token"]
