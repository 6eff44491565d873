"""While a prefill runs layer by layer, the prefetcher evicts blocks of layers the prompt has passed before blocks
of the layer it is at or of later layers (which the prompt will likely need); decode keeps plain LRU."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache_shm"))
from moestream_fake_store import make_fake_store  # noqa: E402

import prefetcher.core as core  # noqa: E402
from cache_shm.client import CacheClient  # noqa: E402
from cache_shm.shm import CacheShm  # noqa: E402
from tests.prefetcher.test_prefetch_policy import serve_all  # noqa: E402


@pytest.fixture()
def rig(tmp_path):
    store = make_fake_store(tmp_path, n_layers=3, n_experts=8)
    shm = CacheShm.create(store, n_slots=4, n_workers=2, prefetch_depth=1)
    pf = core.Prefetcher(shm)
    yield shm, pf, CacheClient(shm)
    shm.close()


def fill(shm, pf, c):
    """Least recent first: layer 2's experts 0 and 1, then layer 0's."""
    for layer in (2, 0):
        c.request(layer, [0, 1])
        pf.step()
        serve_all(shm, pf)
        serve_all(shm, pf)


@pytest.mark.parametrize("prefill", [True, False])
def test_prefill_at_layer_1_evicts_layer_0_not_layer_2(rig, prefill):
    shm, pf, c = rig
    fill(shm, pf, c)
    if prefill:
        c.request_prefill(1, [5])
    else:                       # the twin: the same miss at decode, plain LRU
        c.request(1, [5])
    pf.step()
    serve_all(shm, pf)
    kept = {(j, e) for j in range(3) for e in range(8) if shm.slot_of_expert[j, e] >= 0}
    assert (1, 5) in kept
    layer0, layer2 = {(0, 0), (0, 1)} & kept, {(2, 0), (2, 1)} & kept
    if prefill:
        assert len(layer0) == 1 and len(layer2) == 2, kept
    else:
        assert len(layer2) == 1 and len(layer0) == 2, kept


def test_decode_after_prefill_is_plain_lru_again(rig):
    shm, pf, c = rig
    fill(shm, pf, c)
    c.request_prefill(1, [5])
    pf.step()
    serve_all(shm, pf)
    c.request(1, [6])            # decode: the least recent, one of layer 2's, goes
    pf.step()
    serve_all(shm, pf)
    assert (shm.slot_of_expert[2, 0] < 0) + (shm.slot_of_expert[2, 1] < 0) == 1 and shm.slot_of_expert[1, 6] >= 0


# ------------------------------------------------------------------------------------------------ reads wait
@pytest.fixture()
def full(tmp_path):
    """Six slots, one IO worker (so a prefill keeps min_inflight = 2 reads going): least recent first, layer 2's
    experts 0 and 1, then layer 1's, then layer 0's."""
    store = make_fake_store(tmp_path, n_layers=3, n_experts=8)
    shm = CacheShm.create(store, n_slots=6, n_workers=1, prefetch_depth=1)
    c = CacheClient(shm)
    yield shm, c
    shm.close()


def _fill_later_first(shm, pf, c):
    for layer in (2, 1, 0):
        c.request(layer, [0, 1])
        pf.step()
        serve_all(shm, pf)
        serve_all(shm, pf)
    assert (shm.slot_key >= 0).all()


def _held(shm):
    return {(j, e) for j in range(3) for e in range(8) if shm.slot_of_expert[j, e] >= 0}


@pytest.mark.parametrize("reads,order", [("as_slots_free", "release_then_done"), ("as_slots_free", "done_then_release"),
                                         ("at_once", None)])
def test_prefill_reads_wait_for_the_layers_own_slots(full, reads, order):
    """MoE layer 0 of a prompt: two hits (pinned while their kernels run) and two misses in a cache full of later
    layers' blocks. The misses wait until the prompt reports the hits done, then take their slots; layers 1 and 2
    keep every block. The twin (every read gets its slot when queued) evicts later layers' blocks the prompt is
    about to need."""
    shm, c = full
    pf = core.Prefetcher(shm, prefill_reads=reads)
    _fill_later_first(shm, pf, c)
    later = {(1, 0), (1, 1), (2, 0), (2, 1)}
    hits = c.lookup(0, [0, 1, 2, 3])
    assert sorted(hits) == [0, 1]
    c.request_prefill(0, [0, 1, 2, 3])
    pf.step()
    served = serve_all(shm, pf)
    if reads == "at_once":
        assert len(served) == 2 and len(later & _held(shm)) == 2, _held(shm)
        return
    assert served == [] and later <= _held(shm), "a read took a later layer's block while the hits were in use"
    # gpu_worker/streaming.py unpins, then reports done; the layer's last blocks are reported while still pinned
    first, second = ((lambda: c.release(list(hits.values())), lambda: c.done_prefill(0, [0, 1]))
                     if order == "release_then_done" else
                     (lambda: c.done_prefill(0, [0, 1]), lambda: c.release(list(hits.values()))))
    first()
    pf.step()
    assert serve_all(shm, pf) == [] and later <= _held(shm), "a read went ahead of blocks about to come back"
    second()
    pf.step()
    serve_all(shm, pf)
    assert _held(shm) == later | {(0, 2), (0, 3)}


def test_prefill_reads_go_ahead_when_nothing_comes_back(tmp_path):
    """Layer 0 of a prompt holds no block in the cache (the last prompt left later layers' blocks): nothing will be
    reported done, so min_inflight reads go ahead and take the least recent blocks; the next waits for one of
    them to be reported done and takes its slot."""
    store = make_fake_store(tmp_path, n_layers=3, n_experts=8)
    shm = CacheShm.create(store, n_slots=6, n_workers=1, prefetch_depth=1)
    try:
        c, pf = CacheClient(shm), None
        pf = core.Prefetcher(shm)
        for layer in (2, 1):
            c.request(layer, [0, 1, 2])
            pf.step()
            for _ in range(3):
                serve_all(shm, pf)
        assert pf.min_inflight == 2
        c.request_prefill(0, [4, 5, 6])
        pf.step()
        serve_all(shm, pf)
        held = _held(shm)
        assert {(0, 4), (0, 5)} <= held and (0, 6) not in held
        assert not {(2, 0), (2, 1)} & held and {(2, 2), (1, 0), (1, 1), (1, 2)} <= held
        c.done_prefill(0, [4])
        pf.step()
        serve_all(shm, pf)
        held = _held(shm)
        assert (0, 6) in held and (0, 4) not in held and {(2, 2), (1, 0), (1, 1), (1, 2)} <= held
    finally:
        shm.close()


def test_prefill_reads_take_the_layers_unasked_blocks_before_later_layers(full):
    """Nothing comes back, and the layer holds blocks the prompt did not ask for: the read that must go ahead takes
    one of those, not a later layer's; the next waits for the first to come back (one read is in flight for the one
    waiting), and takes its slot."""
    shm, c = full
    pf = core.Prefetcher(shm)
    _fill_later_first(shm, pf, c)
    c.request_prefill(0, [4, 5])
    pf.step()
    serve_all(shm, pf)
    held = _held(shm)
    assert (0, 4) in held and (0, 5) not in held and len({(0, 0), (0, 1)} & held) == 1
    assert {(1, 0), (1, 1), (2, 0), (2, 1)} <= held
    c.done_prefill(0, [4])
    pf.step()
    serve_all(shm, pf)
    held = _held(shm)
    assert (0, 5) in held and (0, 4) not in held and {(1, 0), (1, 1), (2, 0), (2, 1)} <= held


def test_prefill_prefetch_never_evicts_a_needed_block(full):
    """The next layer's guess takes only spent slots: with none free it waits, where a demand read would go."""
    shm, c = full
    pf = core.Prefetcher(shm)
    _fill_later_first(shm, pf, c)
    hits = c.lookup(0, [0, 1])
    c.request_prefill(0, [0, 1], guess=[4, 5], guess_layer=1)
    pf.step()
    assert serve_all(shm, pf) == []
    assert {(1, 0), (1, 1), (2, 0), (2, 1)} <= _held(shm)
    c.done_prefill(0, [0, 1])
    c.release(list(hits.values()))
    pf.step()
    serve_all(shm, pf)
    serve_all(shm, pf)
    assert {(1, 4), (1, 5)} <= _held(shm) and {(1, 0), (1, 1), (2, 0), (2, 1)} <= _held(shm)
