"""bench/vram_tier.py: the repeat rate and the tier replays on hand-made traces, the bytes model at its ends,
and the thrash the bench exists to show (LRU below one token's working set serves nothing; frequency
admission does)."""
import itertools
from collections import Counter

import pytest

from bench.policy_sim import Trace
from bench.vram_tier import POLICIES, SUPER, evaluate, repeat_rate, super_bytes, tier_replay


def _trace(tokens, n_layers=2, n_experts=8):
    """tokens: per token, per layer, the experts chosen."""
    steps = [(j, tuple(ex), ()) for tok in tokens for j, ex in enumerate(tok)]
    return Trace(steps, n_layers, n_experts, len(tokens))


def test_repeat_rate_counts_same_layer_previous_token():
    t = _trace([[(0, 1), (2, 3)], [(0, 4), (2, 3)], [(5, 6), (3, 7)]])
    # token 1: layer 0 keeps 1 of 2, layer 1 keeps 2 of 2; token 2: 0 of 2, 1 of 2
    assert repeat_rate(t) == pytest.approx((1 + 2 + 0 + 1) / 8)


def test_replays_at_their_ends():
    t = _trace([[(0, 1), (2, 3)], [(0, 4), (2, 3)], [(0, 1), (3, 7)], [(0, 1), (2, 3)]])
    keys = [t.key(j, e) for j, ex, _ in t.steps for e in ex]
    uses, count = len(keys), Counter(keys)
    for pol in POLICIES:
        r = tier_replay(t, 0, pol)
        assert r["hits"] == 0 and r["admissions"] == 0, pol
    big = len(count)
    assert tier_replay(t, big, "lru")["hits"] == uses - len(count)       # every key misses once, then stays
    assert tier_replay(t, big, "engine")["hits"] == sum(max(c - 2, 0) for c in count.values())
    assert tier_replay(t, big, "oracle")["hits"] == uses
    for pol in ("engine", "lru", "freq"):
        assert tier_replay(t, 2, pol)["hits"] <= uses - len(count), pol


def test_oracle_is_the_best_static_set_and_a_wrong_one_is_caught():
    t = _trace([[(0, 1), (2, 3)], [(0, 4), (2, 3)], [(0, 1), (3, 7)], [(0, 5), (2, 6)]])
    keys = [t.key(j, e) for j, ex, _ in t.steps for e in ex]
    for cap in (1, 2, 3):
        best = max(sum(k in set(s) for k in keys) for s in itertools.combinations(set(keys), cap))
        assert tier_replay(t, cap, "oracle")["hits"] == best
        worst = sorted(Counter(keys).items(), key=lambda kv: kv[1])[:cap]      # the twin: least used pinned
        assert sum(k in dict(worst) for k in keys) < best


def test_lru_thrashes_below_the_working_set_and_frequency_admission_does_not():
    # every token uses the same 6 experts per layer plus one of 4 rotating ones; the tier holds 8 of 14 per token
    tokens = [[tuple(range(6)) + (6 + (i % 4),) for _ in range(2)] for i in range(40)]
    t = _trace(tokens, n_experts=10)
    assert tier_replay(t, 8, "lru")["hits"] == 0
    freq = tier_replay(t, 8, "freq")
    assert freq["hits"] > 0.5 * freq["uses"] and freq["admissions"] < 0.05 * freq["uses"]
    # the engine's own tier (gpu_worker/vram_tier.py) behaves as freq does; its former rule (lru2) thrashes
    engine, lru2 = tier_replay(t, 8, "engine"), tier_replay(t, 8, "lru2")
    assert engine["hits"] > 0.5 * engine["uses"] and engine["admissions"] < 0.05 * engine["uses"]
    assert lru2["hits"] == 0 and lru2["admissions"] > 0.5 * lru2["uses"]


def test_bytes_model_and_evaluate():
    f = 0.5
    uses = SUPER["moe_layers"] * SUPER["top_k"]
    assert super_bytes(0, 0, f) == uses * (SUPER["up_bytes"] + f * SUPER["down_bytes"])
    assert super_bytes(1, 0, f) == 0 and super_bytes(1, 1, f) == uses * SUPER["block_bytes"]
    t = _trace([[(0, 1), (2, 3)], [(0, 4), (2, 3)]] * 5)
    res = evaluate(t, "hand", [0.5, 2.0], f, 26.0, scale=True)
    assert {r["policy"] for r in res["rows"]} == set(POLICIES)
    for r in res["rows"]:
        assert r["bytes_per_token"] + r["bytes_saved_per_token"] == pytest.approx(res["base_bytes_per_token"])
