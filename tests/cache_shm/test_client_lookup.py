"""`CacheClient.lookup_slots`, the decode route's lookup: aligned with the experts it was given, hits pinned
once, a block unpublished between the read and the pin a miss (its pin undone), counters as `lookup`'s."""
from __future__ import annotations

import numpy as np
import pytest

from cache_shm.client import CacheClient
from cache_shm.shm import CLC, CacheShm
from moestream_fake_store import make_fake_store


@pytest.fixture()
def shm(tmp_path):
    shm = CacheShm.create(make_fake_store(tmp_path, n_layers=2, n_experts=64), n_slots=80, n_workers=1)
    yield shm
    shm.close()


def publish(shm, layer: int, slot_of: dict[int, int]) -> None:
    for e, s in slot_of.items():
        shm.ready_of_expert[layer, e] = s


class EvictingLock:
    """The client's lock, where a prefetcher unpublishes `expert` while the client's pins are being taken (its
    eviction lands between the client's first read and its second)."""

    def __init__(self, shm, layer: int, expert: int):
        self.shm, self.layer, self.expert, self.fired = shm, layer, expert, False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.fired:
            self.fired = True
            self.shm.ready_of_expert[self.layer, self.expert] = -1


def test_slots_aligned_with_the_experts_hits_pinned(shm):
    c = CacheClient(shm)
    publish(shm, 1, {5: 10, 9: 3, 40: 77})
    experts = [9, 0, 40, 5, 63]
    slots = c.lookup_slots(1, experts)
    assert slots == [3, -1, 77, 10, -1]
    assert shm.slot_pins[[3, 77, 10]].tolist() == [1, 1, 1] and shm.slot_pins.sum() == 3
    assert dict(c.lookup(1, experts)) == {e: s for e, s in zip(experts, slots) if s >= 0}   # the dict lookup agrees
    assert c.lookup_slots(1, [40]) == [77] and c.lookup_slots(1, []) == []
    cc = shm.client_counters
    assert (cc[CLC["lookups"]], cc[CLC["lookup_hits"]], cc[CLC["lookup_misses"]]) == (4, 7, 4)
    c.release([3, 77, 10] * 2 + [77])
    assert (shm.slot_pins == 0).all()


@pytest.mark.parametrize("rereads", [True, False])
def test_unpublished_between_read_and_pin_is_a_miss(shm, rereads):
    """The eviction race. Twin (rereads=False): a client whose second read sees a stale copy of the index hands
    out the evicted slot, and the check catches it."""
    c = CacheClient(shm)
    publish(shm, 0, {1: 4, 2: 5, 3: 6})
    c._lock = EvictingLock(shm, 0, 2)
    if not rereads:
        c._rdy_rows[0] = memoryview(np.array(shm.ready_of_expert[0]))   # the second read: a snapshot
    slots = c.lookup_slots(0, [1, 2, 3])
    ok = slots == [4, -1, 6] and shm.slot_pins[5] == 0 and shm.slot_pins[[4, 6]].tolist() == [1, 1]
    assert ok == rereads, (slots, shm.slot_pins[[4, 5, 6]].tolist())


@pytest.mark.parametrize("all_or_none", [True, False])
def test_lookup_all_pins_nothing_unless_every_expert_is_ready(shm, all_or_none):
    """Every expert ready: pinned and counted, as lookup_slots. One missing: the slots read, nothing pinned or counted
    (the caller sends its request, then pins). Twin (all_or_none=False): a lookup that pins what it found is caught."""
    c = CacheClient(shm)
    publish(shm, 1, {5: 10, 9: 3, 40: 77})
    if not all_or_none:
        c.lookup_all = lambda layer, experts: (c.lookup_slots(layer, experts), False)
    assert c.lookup_all(1, [9, 40]) == ([3, 77], True) or not all_or_none
    c.release([3, 77])
    before = shm.client_counters.copy()
    slots, pinned = c.lookup_all(1, [9, 0, 40])
    ok = (slots, pinned) == ([3, -1, 77], False) and (shm.slot_pins == 0).all() and (
        shm.client_counters == before).all()
    assert ok == all_or_none, (slots, pinned, shm.slot_pins[[3, 77]])
