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
