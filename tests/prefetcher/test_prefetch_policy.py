"""Prefetcher logic in one process (no workers): policies, ordering, pins, accounting, recovery (with `lru`, whose order
the assertions name; the default `reuse` has its own tests in test_policy_reuse.py)."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache_shm"))
from moestream_fake_store import make_fake_store  # noqa: E402

import prefetcher.core as core  # noqa: E402
from cache_shm.client import CacheClient  # noqa: E402
from cache_shm.shm import DEMAND, DONE, EMPTY, LOADING, PREFETCH, READY, REQ, CacheShm  # noqa: E402
from prefetcher.policy import LFUAwareLRUPolicy, LRUPolicy, make_policy  # noqa: E402


def test_lru_order_and_skip():
    p = LRUPolicy(1, 8)
    for s in range(4):
        p.insert(s, s)
    p.touch(0, 0)
    assert p.choose_victim(lambda s: True) == 1
    assert p.choose_victim(lambda s: s not in (1, 2)) == 3
    p.remove(3)
    assert p.choose_victim(lambda s: s not in (1, 2)) == 0
    assert p.choose_victim(lambda s: False) is None


def test_lfu_aware_keeps_popular_expert():
    p = LFUAwareLRUPolicy(1, 8, window=4)
    for s in range(4):
        p.insert(s, s)
    for _ in range(5):
        p.touch(0, 0)                # expert 0 popular ...
    p.insert(0, 0)                   # ... but re-inserted: now MRU anyway
    p._order.move_to_end(0, last=False)   # force it least recent
    assert p.choose_victim(lambda s: True) == 1    # LRU would say 0
    with pytest.raises(ValueError, match="unknown cache policy"):
        make_policy("fifo", 1, 1)


@pytest.fixture()
def rig(tmp_path):
    store = make_fake_store(tmp_path, n_layers=2, n_experts=8)
    shm = CacheShm.create(store, n_slots=4, n_workers=2, prefetch_depth=1)
    pf = core.Prefetcher(shm, "lru")
    yield shm, pf, CacheClient(shm)
    shm.close()


def fake_worker(shm, w, ok=True):
    """Serve worker w's rings the way io_workers does, without reading: demand first."""
    served = []
    for ring in (shm.demand_rings[w], shm.prefetch_rings[w]):
        while (rec := ring.pop()) is not None:
            gen, slot, layer, expert, kind, _ = REQ.unpack(rec)
            shm.slot_state[slot] = READY
            shm.ready_of_expert[layer, expert] = slot
            shm.done_rings[w].push(DONE.pack(gen, slot, 1, kind))
            served.append((layer, expert, kind))
    return served


def serve_all(shm, pf):
    out = []
    for w in range(shm.n_workers):
        out += fake_worker(shm, w)
    pf.step()
    return out


def test_demand_and_prefetch_requests(rig):
    shm, pf, c = rig
    c.request(0, [1, 2], guess=[3, 4, 5])
    pf.step()
    assert sorted(len(r) for r in shm.demand_rings) == [1, 1]          # spread over workers
    assert sum(len(r) for r in shm.prefetch_rings) == 2               # depth 1 per worker
    assert shm.pf_counters[core.PFC["misses"]] == 2
    served = serve_all(shm, pf)
    assert [k for _, _, k in served].count(DEMAND) == 2
    assert all(shm.slot_state[shm.slot_of_expert[l, e]] == READY for l, e, _ in served)
    # completions made room for the third guess: it evicts the least recent slot
    assert c.stats()["prefetch_issued"] == 3 and c.stats()["evictions"] == 1
    serve_all(shm, pf)
    c.request(1, [3], guess=[])
    pf.step()
    st = c.stats()
    assert st["hits"] == 1 and st["prefetch_used"] == 1


def test_undispatched_guesses_dropped_when_layer_runs(rig):
    shm, pf, c = rig
    c.request(0, [], guess=[1, 2, 3, 4, 5])      # depth 1 x 2 workers: 3 stay queued
    pf.step()
    assert c.stats()["prefetch_queue"] == 5
    c.request(1, [5, 6])                          # 5: queued guess becomes a demand; 3, 4 dropped
    pf.step()
    st = c.stats()
    assert st["prefetch_cancelled"] == 2 and st["demand_reads"] == 2 and st["prefetch_issued"] == 2


def test_pinned_slot_is_never_evicted(rig):
    shm, pf, c = rig
    c.request(0, [0, 1, 2, 3])
    pf.step()
    serve_all(shm, pf)
    pinned = c.lookup(0, [0])[0]
    for e in range(4, 8):
        c.request(0, [e])
        pf.step()
        serve_all(shm, pf)
    assert shm.slot_of_expert[0, 0] == pinned and shm.slot_key[pinned] == 0
    assert c.stats()["evictions"] == 4


def test_all_pinned_stalls_then_proceeds(rig):
    shm, pf, c = rig
    c.request(0, [0, 1, 2, 3])
    pf.step()
    serve_all(shm, pf)
    held = c.lookup(0, [0, 1, 2, 3])
    c.request(1, [0])
    pf.step()
    assert shm.slot_of_expert[1, 0] == -1 and c.stats()["stalls_no_slot"] >= 1
    c.release(held[2])
    pf.step()
    assert shm.slot_of_expert[1, 0] == held[2]


def test_pin_taken_during_eviction_wins(rig, monkeypatch):
    """The race: the client pins the victim between the prefetcher's choice and its pin check."""
    shm, pf, c = rig
    c.request(0, [0, 1, 2, 3])
    pf.step()
    serve_all(shm, pf)
    victim = int(shm.slot_of_expert[0, 0])   # least recently used
    calls = []

    def racing_fence():
        if not calls:
            shm.slot_pins[victim] += 1        # the client's pin lands right now
        calls.append(1)
    monkeypatch.setattr(core, "full_fence", racing_fence)
    c.request(1, [5])
    pf.step()
    assert shm.slot_of_expert[0, 0] == victim and shm.slot_state[victim] == READY
    assert shm.slot_key[victim] == 0
    assert shm.slot_of_expert[1, 5] not in (-1, victim)


def test_prefetch_wasted_when_evicted_unused(rig):
    shm, pf, c = rig
    c.request(0, [0, 1], guess=[6, 7])
    pf.step()
    serve_all(shm, pf)
    for e in range(2, 6):
        c.request(0, [e])
        pf.step()
        serve_all(shm, pf)
    assert c.stats()["prefetch_wasted"] == 2


def test_restart_rebuilds_and_resets_orphans(rig):
    shm, pf, c = rig
    c.request(0, [0, 1, 2])
    pf.step()                          # three loading, in rings
    fake_worker(shm, 0)                # worker 0 finishes its one; worker 1's stay queued
    orphan = int(np.flatnonzero(shm.slot_state == EMPTY)[0])
    shm.slot_state[orphan] = LOADING   # a crash between assign and push leaves this
    shm.slot_key[orphan] = 8 + 4
    shm.slot_of_expert[1, 4] = orphan
    pf2 = core.Prefetcher(shm, "lru")
    assert shm.slot_state[orphan] == EMPTY and shm.slot_of_expert[1, 4] == -1
    assert sum(len(o) for o in pf2.outstanding) == 2 - 0 and len(pf2.free) == 1
    assert shm.hdr[0] == 2             # epoch bumped: clients re-send
    serve_all(shm, pf2)
    assert all(shm.slot_state[shm.slot_of_expert[0, e]] == READY for e in (0, 1, 2))


def prefetcher_state(shm, pf) -> tuple:
    """What the prefetcher decided: its queues, the reads in the workers' rings, the index, its counters, the order."""
    # (each read's dispatch time left out: the clock differs between the two runs compared)
    rings = [[REQ.unpack(r)[:5] for r in ring.pending()] for w in range(shm.n_workers)
             for ring in (shm.demand_rings[w], shm.prefetch_rings[w])]
    return (list(pf.pending_demand), list(pf.pending_prefetch), rings, shm.slot_of_expert.tolist(),
            shm.ready_of_expert.tolist(), shm.slot_key.tolist(), shm.slot_state.tolist(), shm.pf_counters.tolist(),
            list(pf.policy._order), sorted(pf.prefetched_unused), sorted(pf.credited))


@pytest.mark.parametrize("faithful", [True, False])
def test_layer_records_and_msgpack_messages_decide_the_same(tmp_path, faithful):
    """The same decode (random choices and guesses over 2 layers of 8 experts, a cache of 6 slots, reads served every
    other message) sent as fixed layer records in one cache and as msgpack in another: after every step both
    prefetchers have queued, read, evicted and counted the same. Twin (faithful=False): records whose last actual
    expert is dropped (a miss never read) are caught."""
    from cache_shm import client as client_mod
    rigs = []
    for name in ("record", "msgpack"):
        store = make_fake_store(tmp_path / name, n_layers=2, n_experts=8)
        shm = CacheShm.create(store, n_slots=6, n_workers=2, prefetch_depth=1)
        rigs.append((shm, core.Prefetcher(shm, "lru"), CacheClient(shm)))
    try:
        (shm_r, pf_r, c_r), (shm_m, pf_m, c_m) = rigs
        if not faithful:
            real = shm_r.msg_ring.push_packed

            def drop_last_actual(st, tag, kind, layer, guess_layer, n_actual, *ids):
                if n_actual:
                    ids, n_actual = ids[:n_actual - 1] + ids[n_actual:], n_actual - 1
                return real(client_mod.layer_record(len(ids)), tag, kind, layer, guess_layer, n_actual, *ids)
            shm_r.msg_ring.push_packed = drop_last_actual
        rng = np.random.default_rng(3)
        same = True
        for t in range(30):
            j = t % 2
            actual = rng.choice(8, 3, replace=False).tolist()
            guess = rng.choice(8, 2, replace=False).tolist()
            c_r.request(j, actual, guess)
            c_m._request_msgpack(j, actual, guess, (j + 1) % 2)
            assert shm_r.msg_ring.peek()[0] == client_mod.LAYER_RECORD_TAG
            assert shm_m.msg_ring.peek()[0] != client_mod.LAYER_RECORD_TAG
            for shm, pf, _ in rigs:
                pf.step()
                if t % 2:
                    serve_all(shm, pf)
            same &= prefetcher_state(shm_r, pf_r) == prefetcher_state(shm_m, pf_m)
        assert same == faithful
    finally:
        for shm, _, _ in rigs:
            shm.close()


@pytest.mark.parametrize("hold", [True, False])
def test_reads_ahead_wait_for_the_demand_reads_when_held(rig, hold):
    """hold_ahead: while decoding, no read ahead starts while a demand read is out; the done record of the last one
    lets them go. The twin (not held) sends both at once. A prefill's reads ahead are never held."""
    shm, pf, c = rig
    c.hold_ahead(hold)
    c.request(0, [1], guess=[3, 4])
    pf.step()
    assert sum(len(r) for r in shm.demand_rings) == 1
    assert sum(len(r) for r in shm.prefetch_rings) == (0 if hold else 2)
    assert (c.stats()["prefetch_held"] > 0) == hold
    serve_all(shm, pf)                           # the demand read done: the reads ahead go
    assert c.stats()["prefetch_issued"] == 2
    serve_all(shm, pf)
    c.request_prefill(1, [5], guess=[6], guess_layer=1)
    pf.step()
    assert sum(len(r) for r in shm.prefetch_rings) == 1      # held or not: a prompt's guess goes beside its reads
