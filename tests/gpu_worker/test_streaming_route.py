"""The addressed decode route of `StreamingExperts` (what the decode graphs drive on CUDA), on a cache index written
by hand: block addresses in top-k order from the lookup alone; the message, the counts and the release of the
previous layer's pins only once the kernels are launched; this layer's pins held past its kernels; a layer with a
miss sends its request at once and runs eagerly. The device is the CPU, the source on its CUDA path (block
addresses, pins deferred), which touches no device until the kernels run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cache_shm.client import MSG_LAYER, CacheClient, decode_message
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
        out.append(decode_message(rec))
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
        real_lookup, real_all = src.client.lookup_slots, src.client.lookup_all
        monkeypatch.setattr(src.client, "lookup_slots", lambda j, ex: sorted(real_lookup(j, ex)))
        monkeypatch.setattr(src.client, "lookup_all", lambda j, ex: (sorted(real_all(j, ex)[0]), True))
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
    src.decode_count(r)                             # decode_eager's, once the hits are queued
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


@pytest.mark.parametrize("first", [True, False])
def test_a_miss_in_a_large_cache_sends_its_request_before_the_pins(rig, monkeypatch, first):
    """The disk reads start at the request, so it goes before the hits are pinned; they are pinned before the route
    returns, and the last layer's pins are released with the hits' by `decode_eager` (`_flush` before it waits for
    the misses). Twin (first=False): the order of a small cache (pins and release, then the request) is caught by the
    same check."""
    from gpu_worker import streaming
    src, shm, slot_of = rig
    if not first:
        monkeypatch.setattr(streaming, "REQUEST_FIRST_CHOICES", 10 ** 6)
    src.decode_route(0, 1, [7, 3, 60], [1, 2])       # an all-hits layer whose pins are held past its kernels
    src.decode_launched()
    messages(shm)
    shm.ready_of_expert[1, 41] = -1
    chosen = [5, 41, 9]
    at_request = []
    real = src.client.request

    def request(*a, **k):
        at_request.append([int(shm.slot_pins[slot_of[1, e]]) for e in (5, 9)])
        real(*a, **k)
    monkeypatch.setattr(src.client, "request", request)
    r = src.decode_route(1, 3, chosen, [4])
    assert r.addresses is None and sorted(r.hits) == [5, 9] and messages(shm) == [[MSG_LAYER, 1, chosen, 2, [4]]]
    assert [shm.slot_pins[slot_of[1, e]] for e in chosen] == [1, 0, 1]
    # counted by the route (the old order) or by decode_eager once the hits are queued (request first)
    assert (src.acct.hits_at_lookup, src.acct.misses_at_lookup) == ((3, 0) if first else (5, 1))
    src.decode_count(r)
    assert (src.acct.hits_at_lookup, src.acct.misses_at_lookup) == (5, 1)
    assert (at_request == [[0, 0]]) == first, at_request
    src._defer(list(r.hits.values()))              # decode_eager, its hits' kernels queued: the release before the wait
    src._flush(sync=False)
    assert (shm.slot_pins == 0).all()


@pytest.mark.parametrize("repaired", [True, False])
def test_an_expert_evicted_between_the_request_and_its_pin_is_read_on_demand(rig, monkeypatch, repaired):
    """The race the early request opens: the prefetcher finds expert 9 ready (a touch, no read), then evicts it before
    the client pins it. The route asks for it by a demand read, or the layer would wait for the client's re-send.
    Twin (repaired=False): a client whose demand goes nowhere is caught."""
    from cache_shm.client import MSG_DEMAND
    src, shm, slot_of = rig
    shm.ready_of_expert[1, 41] = -1
    real = src.client.request

    def request_then_evict(*a, **k):
        real(*a, **k)
        shm.ready_of_expert[1, 9] = -1       # the prefetcher's eviction: unpublished, then the slot reused
        shm.slot_of_expert[1, 9] = -1
    monkeypatch.setattr(src.client, "request", request_then_evict)
    if not repaired:
        monkeypatch.setattr(src.client, "demand", lambda *a: None)
    r = src.decode_route(1, 3, [5, 41, 9], [4])
    sent = messages(shm)
    assert sorted(r.hits) == [5] and shm.slot_pins[slot_of[1, 9]] == 0
    assert (sent[1:] == [[MSG_DEMAND, 1, [9], 0, []]]) == repaired, sent


@pytest.mark.parametrize("ranks", [3, 0])
def test_the_request_carries_the_guess_to_its_depth(rig, monkeypatch, ranks):
    """MOESTREAM_PREFETCH_GUESS_RANKS=3: a layer's message carries the next layer's first 3 guessed experts only (the
    prefetcher reads ahead and keeps only those); the knob is read at a token's first MoE layer, so a change within a
    token waits for the next one. The twin (0) sends the whole guess. The staging's guess stays whole."""
    src, shm, _ = rig
    monkeypatch.setenv("MOESTREAM_PREFETCH_GUESS_RANKS", str(ranks))
    guess = [[5, 6, 1, 2, 3, 4], [8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25]]
    sent = []
    for j, ch in enumerate([[7, 3, 60, 0, 41, 12], [5, 6, 1, 63, 22, 9]]):
        if j == 1:
            monkeypatch.setenv("MOESTREAM_PREFETCH_GUESS_RANKS", "1")    # mid-token: not read until layer 0
        src.decode_route(j, 2 * j + 1, ch, guess[j])
        src.decode_launched()                   # (an all-hits layer's message goes once its kernels are queued)
        assert src._next_guess == (j + 1, guess[j])
        sent += [m for m in messages(shm) if m[0] == MSG_LAYER]
    assert [m[4] for m in sent] == [g[:ranks] if ranks else g for g in guess[:2]]
    src.decode_route(0, 1, [7, 3, 60, 0, 41, 12], guess[2])       # the next token: the new depth
    src.decode_launched()
    assert [m[4] for m in messages(shm) if m[0] == MSG_LAYER] == [guess[2][:1]]


def test_a_bad_guess_depth_is_named(monkeypatch):
    from gpu_worker.knobs import prefetch_guess_ranks
    for bad in ("lots", "-2"):
        monkeypatch.setenv("MOESTREAM_PREFETCH_GUESS_RANKS", bad)
        with pytest.raises(ValueError, match="MOESTREAM_PREFETCH_GUESS_RANKS"):
            prefetch_guess_ranks()
    monkeypatch.setenv("MOESTREAM_PREFETCH_GUESS_RANKS", "")
    assert prefetch_guess_ranks() == 16         # the default (session 33)
    monkeypatch.setenv("MOESTREAM_PREFETCH_GUESS_RANKS", "0")
    assert prefetch_guess_ranks() == 0


def test_the_hold_on_reads_ahead_reaches_the_prefetcher_once_a_token(rig, monkeypatch):
    """MOESTREAM_PREFETCH_HOLD is read at a token's first MoE layer and written to the cache's header, where the
    prefetcher reads it (`CacheClient.hold_ahead`); a change within a token waits for the next one. Off (the twin)
    writes 0."""
    from cache_shm.shm import HDR
    src, shm, _ = rig
    guess = [5, 6, 1, 2, 3, 4]
    for token, (at0, later, want) in enumerate([("1", "0", 1), ("0", "1", 0)]):
        monkeypatch.setenv("MOESTREAM_PREFETCH_HOLD", at0)
        src.decode_route(0, 1, [7, 3, 60, 0, 41, 12], guess)
        src.decode_launched()
        monkeypatch.setenv("MOESTREAM_PREFETCH_HOLD", later)          # mid-token: not read until layer 0
        src.decode_route(1, 3, [5, 6, 1, 63, 22, 9], guess)
        src.decode_launched()
        assert int(shm.hdr[HDR["hold_ahead"]]) == want, token
        messages(shm)
