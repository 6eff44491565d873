"""Warm reads (CacheClient.warm, prefetcher/core.py): a cache that holds the whole store is filled from the start,
into free slots only, behind every demand read and read ahead; the engine asks for it only where it fits."""
from __future__ import annotations

import sys
from pathlib import Path

import prefetcher.core as core
from cache_shm.client import CacheClient
from cache_shm.shm import CacheShm, PFC, PREFETCH
from tests.prefetcher.test_prefetch_policy import fake_worker, serve_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache_shm"))
from moestream_fake_store import make_fake_store  # noqa: E402


def rig(tmp_path, n_slots, depth=2):
    store = make_fake_store(tmp_path, n_layers=2, n_experts=8)
    shm = CacheShm.create(store, n_slots=n_slots, n_workers=2, prefetch_depth=depth)
    return shm, core.Prefetcher(shm, "lru"), CacheClient(shm)


def resident(shm):
    return {(j, e) for j in range(2) for e in range(8) if shm.slot_of_expert[j, e] >= 0}


def test_warm_fills_every_free_slot_and_counts_apart(tmp_path):
    shm, pf, c = rig(tmp_path, n_slots=16)
    try:
        for j in range(2):
            c.warm(j, range(8))
        for _ in range(20):
            pf.step()
            serve_all(shm, pf)
        assert resident(shm) == {(j, e) for j in range(2) for e in range(8)}
        cnt = shm.pf_counters
        assert cnt[PFC["warm_reads"]] == 16 and cnt[PFC["evictions"]] == 0
        assert cnt[PFC["prefetch_issued"]] == 0 and cnt[PFC["prefetch_wasted"]] == 0 and cnt[PFC["demand_reads"]] == 0
    finally:
        shm.close()


def test_warm_never_evicts_and_waits_behind_demand(tmp_path):
    """A cache smaller than the store: warm reads take the free slots and stop, evicting nothing; a demand read
    queued beside them goes first (the twin of ordering: demand reads in the same step are on the rings before any
    warm read is)."""
    shm, pf, c = rig(tmp_path, n_slots=5)
    try:
        c.warm(0, range(8))
        c.request(1, [3], guess=[])
        pf.step()
        kinds = [core.REQ.unpack(r)[4] for w in range(2) for r in shm.demand_rings[w].pending()]
        assert kinds == [0]                                       # the demand read, alone on a demand ring
        # the demand read took its slot first, the warm reads the 4 left (warm first would have taken all 5 and
        # made the demand read evict: the evictions below would be 1)
        assert sum(len(r) for r in shm.prefetch_rings) == 4
        for _ in range(20):
            serve_all(shm, pf)
        assert (1, 3) in resident(shm) and len(resident(shm)) == 5
        assert shm.pf_counters[PFC["evictions"]] == 0 and shm.pf_counters[PFC["warm_reads"]] == 4
        c.request(1, [4], guess=[])                               # a later demand read evicts as usual
        for _ in range(5):
            pf.step()
            serve_all(shm, pf)
        assert (1, 4) in resident(shm) and shm.pf_counters[PFC["evictions"]] == 1
    finally:
        shm.close()


def test_a_demand_for_a_warm_block_in_flight_waits_for_it(tmp_path):
    shm, pf, c = rig(tmp_path, n_slots=16, depth=1)
    try:
        c.warm(0, [5])
        pf.step()
        assert sum(len(r) for r in shm.prefetch_rings) == 1 and shm.slot_of_expert[0, 5] >= 0
        c.request(0, [5], guess=[])
        pf.step()
        assert sum(len(r) for r in shm.demand_rings) == 0         # not read twice
        assert shm.pf_counters[PFC["misses_inflight"]] == 1
        for w in range(2):
            fake_worker(shm, w)
        pf.step()
        assert shm.pf_counters[PFC["warm_reads"]] == 1
    finally:
        shm.close()


def test_the_engine_warms_only_a_cache_that_holds_the_store(synth, tmp_path):
    """StreamingEngine(warm_cache=True): with a cache of every expert, all are resident soon after start and a
    prompt then reads nothing from disk; with one slot fewer nothing is warmed (the twin: a partial warm would evict
    nothing but leave the cache's order to chance)."""
    import time

    from expert_store.reader import ExpertStore
    from gpu_worker.engine import StreamingEngine
    from tools import repack
    model_dir = synth("tiny", "nvfp4")
    out = tmp_path / "store"
    assert repack.main(["--model", str(model_dir), "--out", str(out), "--no-progress"]) == 0
    st = ExpertStore.open(out)
    n = len(st.moe_layers) * st.n_experts
    with StreamingEngine(out, cache_bytes=n * st.block_stride, io_workers=2, warm_cache=True) as eng:
        assert eng.warming
        shm, t_end = eng.experts.client.shm, time.time() + 30
        while (shm.slot_of_expert < 0).any() or shm.pf_counters[PFC["warm_reads"]] < n:
            assert time.time() < t_end, "the warm reads did not finish in 30 s"
            time.sleep(0.02)
        assert shm.pf_counters[PFC["evictions"]] == 0 and shm.pf_counters[PFC["demand_reads"]] == 0
    with StreamingEngine(out, cache_bytes=(n - 1) * st.block_stride, io_workers=2, warm_cache=True) as eng:
        assert not eng.warming
        time.sleep(0.2)
        assert eng.experts.client.shm.pf_counters[PFC["warm_reads"]] == 0
