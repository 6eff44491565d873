"""ReusePolicy keeps its victim ranking between evictions (per-layer heaps of (p, tick) entries, refreshed for the
message's layers in observe, a new entry per touch / insert / demote) instead of ranking every resident at each
eviction. The victim must be the full ranking's (`choose_victim_full`): checked on random operations, and the twin
whose touch does not invalidate the kept ranking must be caught by the same check."""
import numpy as np
import pytest

from prefetcher.policy import ReusePolicy


def _random_run(pol, seed, steps=3000, n_slots=60):
    """Random inserts / touches / removes / demotes / layer messages; at each eviction compare the kept ranking's
    victim with the full ranking's, under a random evictable set. Returns the number of disagreements."""
    rng = np.random.default_rng(seed)
    L, E = pol.L, pol.E
    slot_key: dict[int, int] = {}
    free = list(range(n_slots))
    bad = checks = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.08:
            j = int(rng.integers(L))
            actual = rng.choice(E, 3, replace=False)
            g = (j + 1) % L
            pol.observe(j, actual.tolist(), g, rng.choice(E, 3, replace=False).tolist())
        elif op < 0.35 and free:
            s = free.pop(int(rng.integers(len(free))))
            k = int(rng.integers(L * E))
            while k in slot_key.values():
                k = int(rng.integers(L * E))
            slot_key[s] = k
            pol.insert(s, k)
        elif op < 0.7 and slot_key:
            s = list(slot_key)[int(rng.integers(len(slot_key)))]
            pol.touch(s, slot_key[s])
        elif op < 0.75 and slot_key:
            s = list(slot_key)[int(rng.integers(len(slot_key)))]
            pol.demote(s)
        elif slot_key:
            pinned = set(rng.choice(n_slots, int(rng.integers(0, 10)), replace=False).tolist())
            ev = lambda s: s not in pinned          # noqa: E731
            want, got = pol.choose_victim_full(ev), pol.choose_victim(ev)
            checks += 1
            bad += want != got
            if got is not None and rng.random() < 0.7:
                pol.remove(got)
                free.append(got)
                del slot_key[got]
    assert checks > 300
    return bad


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("features", ["layer,age,freq,guess", "age,freq,guess"])
def test_kept_ranking_gives_the_full_rankings_victim(seed, features):
    assert _random_run(ReusePolicy(4, 16, features=features), seed) == 0


class _StaleOnTouch(ReusePolicy):
    """The twin: a touch moves the slot's tick but leaves its old entry live (the kept ranking not invalidated)."""
    def touch(self, slot, key):
        if slot in self:
            self._tick += 1
            self._tick_of_slot[slot] = self._tick
            self._demoted[slot] = False


def test_twin_not_invalidated_on_touch_is_caught():
    assert sum(_random_run(_StaleOnTouch(4, 16), seed) for seed in range(4)) > 0
