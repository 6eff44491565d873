"""The addressed decode route of `StreamingExperts` (what the decode graphs drive on CUDA), on a cache index written
by hand: block addresses in top-k order from the lookup alone; the message, the counts and the release of the
previous layer's pins only once the kernels are launched; this layer's pins held past its kernels; a layer with a
miss sends its request at once and runs eagerly. The device is the CPU, the source on its CUDA path (block
addresses, pins deferred), which touches no device until the kernels run."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from cache_shm.client import MSG_LAYER, CacheClient
from cache_shm.cuda_map import slab_tensor
from cache_shm.shm import CacheShm
from gpu_worker.streaming import StreamingExperts
from kernels.expert_block import ExpertGeometry
from tests.cache_shm.moestream_fake_store import make_fake_store

N_MOE, N_EXPERTS, K = 3, 64, 6


@pytest.fixture()
def rig(tmp_path):
    """(source on its CUDA path, shm, {(layer, expert): slot} of the published blocks)."""
    geom = ExpertGeometry(L=64, I=32)
    store = make_fake_store(tmp_path, n_layers=N_MOE, n_experts=N_EXPERTS, block_bytes=geom.block_bytes)
    store.geometry = geom
    store.up_global = np.ones((N_MOE, N_EXPERTS), np.float32)
    store.down_global = np.ones((N_MOE, N_EXPERTS), np.float32)
    shm = CacheShm.create(store, n_slots=N_MOE * N_EXPERTS, n_workers=1)
    rng = np.random.default_rng(0)
    slot_of = {}
    for j, perm in enumerate(rng.permutation(N_MOE * N_EXPERTS).reshape(N_MOE, N_EXPERTS)):
        for e in range(N_EXPERTS):
            slot_of[j, e] = int(perm[e])
            shm.ready_of_expert[j, e] = perm[e]
    src = StreamingExperts(store, CacheClient(shm), "cpu", slab_tensor(shm))
    src._cuda = src._addressed = True
    yield src, shm, slot_of
    shm.close()


def messages(shm) -> list:
    out = []
    while (rec := shm.msg_ring.pop()) is not None:
        out.append(msgpack.unpackb(rec))
    return out


def route_problems(src, shm, slot_of) -> list[str]:
    """Two layers through decode_route / decode_launched, every expectation checked; what went wrong."""
    bad = []
    pins = shm.slot_pins
    base, sb = src.slab.data_ptr(), src.slot_bytes
    chosen = [[7, 3, 60, 0, 41, 12], [5, 6, 1, 63, 22, 9]]
    guess = [[5, 6, 1, 2, 3, 4], [8, 9, 10, 11, 12, 13]]
    for j in range(2):
        r = src.decode_route(j, 2 * j + 1, chosen[j], guess[j])
        want = [base + slot_of[j, e] * sb for e in chosen[j]]
        if r.addresses != want:
            bad.append(f"layer {j}: addresses {r.addresses} != {want}")
        if not r.count_down_groups:
            bad.append(f"layer {j}: slab-only layer does not count its down groups")
        if any(pins[slot_of[j, e]] != 1 for e in chosen[j]):
            bad.append(f"layer {j}: hits not pinned before the launch")
        if messages(shm):
            bad.append(f"layer {j}: message sent before the launch")
        if j == 1 and any(pins[slot_of[0, e]] != 1 for e in chosen[0]):
            bad.append("layer 0's pins released before layer 1's kernels were launched")
        src.decode_launched()
        got = messages(shm)
        if got != [[MSG_LAYER, j, chosen[j], j + 1, guess[j]]]:
            bad.append(f"layer {j}: messages after the launch {got}")
        if any(pins[slot_of[j, e]] != 1 for e in chosen[j]):
            bad.append(f"layer {j}: pins released before its kernels ran")
    if any(pins[slot_of[0, e]] != 0 for e in chosen[0]):
        bad.append("layer 0's pins still held after layer 1's launch")
    a = src.acct
    if (a.tokens, a.hits_at_lookup, a.misses_at_lookup) != (1, 2 * K, 0):
        bad.append(f"counts: tokens {a.tokens}, hits {a.hits_at_lookup}, misses {a.misses_at_lookup}")
    if a.bytes_over_pcie != 2 * K * src.geom.up_bytes:
        bad.append(f"bytes over PCIe {a.bytes_over_pcie}")
    return bad


def test_addressed_route(rig):
    src, shm, slot_of = rig
    assert route_problems(src, shm, slot_of) == []
    src._flush(sync=False)
    assert (shm.slot_pins == 0).all()


@pytest.mark.parametrize("broken", ["pins released at the launch", "slots out of order", "no message"])
def test_twin_broken_route_is_caught(rig, monkeypatch, broken):
    src, shm, slot_of = rig
    if broken == "pins released at the launch":
        real = src.decode_launched

        def careless():
            real()
            src._flush(sync=False)
        monkeypatch.setattr(src, "decode_launched", careless)
    elif broken == "slots out of order":
        real_lookup = src.client.lookup_slots
        monkeypatch.setattr(src.client, "lookup_slots", lambda j, ex: sorted(real_lookup(j, ex)))
    else:
        monkeypatch.setattr(src.client, "request", lambda *a, **k: None)
    assert route_problems(src, shm, slot_of) != []


@pytest.mark.parametrize("honest", [True, False])
def test_a_miss_sends_the_request_at_once_and_runs_eagerly(rig, monkeypatch, honest):
    """Twin (honest=False): a lookup that reports the missing block as present (slot 0) is caught."""
    src, shm, slot_of = rig
    shm.ready_of_expert[2, 41] = -1                 # not (yet) in the cache
    if not honest:
        real_lookup = src.client.lookup_slots
        monkeypatch.setattr(src.client, "lookup_slots", lambda j, ex: [max(s, 0) for s in real_lookup(j, ex)])
    chosen, guess = [7, 41, 3], [1, 2]
    r = src.decode_route(2, 5, chosen, guess)
    sent = messages(shm)
    ok = (r.addresses is None and r.rest == chosen and sorted(r.hits) == [3, 7]
          and sent == [[MSG_LAYER, 2, chosen, 0, guess]]      # at once; the guess is for the first MoE layer
          and [shm.slot_pins[slot_of[2, e]] for e in chosen] == [1, 0, 1]
          and (src.acct.hits_at_lookup, src.acct.misses_at_lookup) == (2, 1))
    assert ok == honest, (r, sent)
    if honest:
        src.decode_launched()                       # nothing was launched: nothing more happens
        assert messages(shm) == [] and src.acct.hits_at_lookup == 2


def test_vram_tier_and_slab_addresses_mixed(rig):
    from gpu_worker.vram_tier import VramTier
    src, shm, slot_of = rig
    vt = src.vram = VramTier(4, src.slot_bytes, src.block_bytes, "cpu", admit_after=1)
    for e in (3, 12):
        vt.admit(0, e, src.slab[slot_of[0, e], :src.block_bytes])
    chosen = [7, 3, 60, 12]
    r = src.decode_route(0, 1, chosen, [5, 6])
    want = [src.slab.data_ptr() + slot_of[0, 7] * src.slot_bytes, vt.buf[vt.slot_of[0, 3]].data_ptr(),
            src.slab.data_ptr() + slot_of[0, 60] * src.slot_bytes, vt.buf[vt.slot_of[0, 12]].data_ptr()]
    assert r.addresses == want and not r.count_down_groups
    assert shm.slot_pins[slot_of[0, 3]] == 0 and shm.slot_pins[slot_of[0, 7]] == 1
    assert vt._sc[0][3] == 1.0                 # the uses the route found are counted after the launch ...
    src.decode_launched()
    assert vt.score[0, 3] == vt.score[0, 12] == 1.0 + vt._w       # ... at this token's weight
    assert messages(shm) == [[MSG_LAYER, 0, [7, 60], 1, [5, 6]]]
    assert src.acct.vram_hits == 2 and src.acct.bytes_from_vram == 2 * src.block_bytes
    assert torch.equal(vt.block(vt.slot_of[0, 7]), src.slab[slot_of[0, 7], :src.block_bytes])   # admitted
