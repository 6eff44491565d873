"""The segmented LRU (2Q-like) and ARC eviction policies: their defining behaviour on hand-made sequences, each
against plain LRU (the twin that lacks the behaviour), plus the interface every policy keeps (pins, demote,
remove)."""
from __future__ import annotations

import pytest

from prefetcher.policy import ARCPolicy, LRUPolicy, SegmentedLRUPolicy, make_policy


def fill(policy, n):
    for s in range(n):
        policy.insert(s, s)
    return policy


@pytest.mark.parametrize("make", [lambda: SegmentedLRUPolicy(1, 16), lambda: ARCPolicy(1, 16)])
def test_a_slot_used_twice_outlives_newer_one_offs(make):
    """Slot 0 is inserted, then used again; 1-3 arrive after it and are never used (wrong guesses read ahead).
    LRU evicts 0 (the oldest); the frequency-aware policies evict 1, the oldest one-off."""
    for p, want in ((make(), 1), (LRUPolicy(1, 16), 0)):
        p.insert(0, 0)
        p.touch(0, 0)
        for s in (1, 2, 3):
            p.insert(s, s)
        assert p.choose_victim(lambda s: True) == want, type(p).__name__


def test_slru_ghost_brings_a_recently_evicted_expert_back_protected():
    p = fill(SegmentedLRUPolicy(1, 16, protected=0.5), 4)
    for s in (1, 2):
        p.touch(s, s)                       # 1, 2 protected; 0, 3 on probation
    assert p.choose_victim(lambda s: True) == 0
    p.remove(0)                             # expert 0 leaves, remembered
    p.insert(0, 0)                          # ... and comes back at once: protected
    p.insert(4, 4)
    assert p.choose_victim(lambda s: True) == 3
    q = fill(SegmentedLRUPolicy(1, 16, protected=0.5, ghost=0.0), 4)   # twin: no ghost, back on probation
    for s in (1, 2):
        q.touch(s, s)
    q.remove(0)
    q.insert(0, 0)
    q.insert(4, 4)
    q.remove(3)
    assert q.choose_victim(lambda s: True) == 0


def test_slru_protected_share_is_bounded():
    p = fill(SegmentedLRUPolicy(1, 16, protected=0.5), 8)
    for s in range(8):
        p.touch(s, s)                       # all used twice: only half stay protected
    assert len(p._prot) == 4 and len(p) == 8
    assert p.choose_victim(lambda s: True) == 0     # the oldest protected fell back to probation first
    with pytest.raises(ValueError, match="protected share"):
        SegmentedLRUPolicy(1, 4, protected=1.0)


def test_arc_adapts_towards_recency_on_b1_hits():
    p = fill(ARCPolicy(1, 64), 4)           # c = 4
    assert p.c == 4 and p.p == 0
    v = p.choose_victim(lambda s: True)
    assert v == 0
    p.remove(0)                             # 0 -> ghost B1
    p.insert(0, 0)                          # a miss found in B1: recency was short, T1's target grows
    assert p.p >= 1 and 0 in p and p._t2.get(0) == 0


def test_arc_scan_resistance_against_lru():
    """A hot set of 3 used over and over, then a one-time scan of 20 new experts through a 4-slot cache, then
    the hot set again: ARC keeps (most of) the hot set through the scan, LRU keeps none."""
    def run(policy):
        resident, hits = set(), 0

        def use(k):
            nonlocal hits
            if k in resident:
                hits += 1
                policy.touch(k, k)
                return
            if len(resident) >= 4:
                v = policy.choose_victim(lambda s: True)
                policy.remove(v)
                resident.discard(v)
            policy.insert(k, k)
            resident.add(k)
        for _ in range(5):
            for k in (0, 1, 2):
                use(k)
        for k in range(10, 30):
            use(k)
        before = hits
        for k in (0, 1, 2):
            use(k)
        return hits - before
    assert run(ARCPolicy(1, 64)) >= 2
    assert run(LRUPolicy(1, 64)) == 0


@pytest.mark.parametrize("name", ["slru", "arc", "reuse"])
def test_interface_pins_demote_remove(name):
    p = fill(make_policy(name, 1, 8), 4)
    for s in range(4):
        p.touch(s, s)
    assert p.choose_victim(lambda s: s not in (0, 1)) in (2, 3)
    assert p.choose_victim(lambda s: False) is None
    p.demote(3)
    assert p.choose_victim(lambda s: True) == 3
    p.remove(3)
    assert 3 not in p and len(p) == 3
    p.touch(3, 3)                           # a touch of a slot no longer resident changes nothing
    assert 3 not in p and len(p) == 3
