"""The copies ahead as a flow (gpu_worker/ahead_flow.py, MOESTREAM_PREFILL_AHEAD_FLOW=1), on the CPU, where the ahead
slots are plain tensors and every copy is done at once, so that a copy into a slot before the launch that reads it
has been issued changes the logits: the logits are unchanged (RAM, a cache of one layer), the next layer's blocks are
copied in several pieces as this layer's launches free slots, before its router syncs, the layer's blocks copied ahead
launch before the ones copied at its sync, nothing goes through the staging ring in RAM, no pin is left, and each
routed block is still read at most once. Must-fail twin: the flow given every slot as free at the sync."""
from __future__ import annotations

import pytest
import torch

import gpu_worker.ahead_flow as ahead_flow
from gpu_worker import prefill_experts, slab_copies
import gpu_worker.streaming as streaming
from gpu_worker.engine import StreamingEngine
from gpu_worker.prefill import prefill
from nemotron.model import NemotronH
from tests.gpu_worker.test_prefill import prompt
from tests.gpu_worker.test_prefill_ahead import (StageSpy, _all_experts, gpu_prefills, refs, run,  # noqa: F401
                                                 staged_before_sync, tiny)


@pytest.fixture(autouse=True)
def flow_on(monkeypatch):
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_FLOW", "1")
    # the flow is made for one layer's slots (two, as eager copies take, would hold the next layer's copies whole at
    # the sync: nothing left to flow)
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_LAYERS", "1")


class FlowSpy:
    """Records each flow's copies [(next layer, experts)], the first layer's guess copied ([experts]) and each launch's
    experts in order, per MoE layer."""

    def __init__(self, monkeypatch):
        self.puts, self.launched, self.first = [], [], []
        real_put, real_batch = slab_copies.AheadSlots.put_into, streaming.StreamingExperts._prefill_batch
        real_copy = slab_copies.AheadSlots.copy

        def put_into(slots, layer, experts, *a, **kw):
            self.puts.append((layer, list(experts)))
            return real_put(slots, layer, experts, *a, **kw)

        def copy(slots, layer, experts, *a, **kw):
            k = real_copy(slots, layer, experts, *a, **kw)
            self.first.append(list(experts)[:k])
            return k
        monkeypatch.setattr(slab_copies.AheadSlots, "copy", copy)

        def batch(src, lay, b, *a, **kw):
            self.launched.append((lay.j, [e for e, _ in b]))
            return real_batch(src, lay, b, *a, **kw)
        monkeypatch.setattr(slab_copies.AheadSlots, "put_into", put_into)
        monkeypatch.setattr(streaming.StreamingExperts, "_prefill_batch", batch)

    def clear(self):
        self.puts.clear()
        self.launched.clear()
        self.first.clear()


def _engine(store, model_dir, cache_bytes):
    eng = StreamingEngine(store, model_dir=model_dir, cache_bytes=cache_bytes, io_workers=2)
    eng.experts.copy_ahead, eng.experts.ahead_min_tokens = True, 0     # (the CPU path copies ahead only if told)
    return eng


@pytest.mark.parametrize("n,launch", [(6, ""), (300, ""), (300, "4")])
def test_flow_keeps_the_logits_and_reads_every_block_from_the_slots(tiny, refs, n, launch, monkeypatch):
    """launch "4": launches of 4 experts, several a layer (the flow copies between them)."""
    model_dir, store = tiny
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_MIN_GUESS", "1")
    if launch:
        monkeypatch.setenv("MOESTREAM_PREFILL_LAUNCH_EXPERTS", launch)
    spy, stage = FlowSpy(monkeypatch), StageSpy(monkeypatch)
    with _engine(store, model_dir, _all_experts(store)) as eng:
        src = eng.experts
        run(eng, n)                      # every block in RAM for the second run
        spy.clear()
        stage.staged = 0
        out = run(eng, n)
        last = src.prefill_acct.last
        assert int(eng.sup.shm.slot_pins.sum()) == 0, "pins of the flow's copies were left behind"
    torch.testing.assert_close(out, refs[n], rtol=1e-5, atol=1e-4)
    print(f"{n} tokens: {last.ahead_copied} copied ahead ({len(spy.puts)} pieces), {last.ahead_used} used, "
          f"{last.eager_copied} at the syncs, {last.distinct_experts} routed")
    assert stage.staged == 0, "RAM: every block should come from the ahead slots"
    assert last.ahead_read == last.distinct_experts == last.ahead_used + last.eager_copied
    assert all(layer > 0 for layer, _ in spy.puts), "the flow copied for the first MoE layer"
    assert last.ahead_copied == sum(len(ex) for _, ex in spy.puts) + sum(len(ex) for ex in spy.first)
    assert spy.puts, "the flow copied nothing"
    assert staged_before_sync(src)


@pytest.mark.parametrize("twin", [False, True])
def test_flow_copies_in_pieces_and_launches_the_copied_first(tiny, twin, monkeypatch):
    """300 tokens route to most of a layer's experts: the next layer's copies go in more than one piece (the slots
    free at the sync are too few), and in each layer the experts copied ahead launch before those copied at the sync.
    Must-fail twin: the launches in expert order, as without the flow, are caught by the order check."""
    model_dir, store = tiny
    if twin:
        monkeypatch.setattr(prefill_experts, "launch_order", lambda hits, ahead: list(hits.items()))
    spy = FlowSpy(monkeypatch)
    copied_at_sync: dict[int, set] = {}
    real_start = streaming.StreamingExperts._flow_start

    def flow_start(src, j, nj, hits, ahead, g):
        got = real_start(src, j, nj, hits, ahead, g)
        if got is not None:
            copied_at_sync[j] = set(got[1]) - set(ahead)
        return got
    monkeypatch.setattr(streaming.StreamingExperts, "_flow_start", flow_start)
    with _engine(store, model_dir, _all_experts(store)) as eng:
        run(eng, 300)
        spy.clear()
        run(eng, 300)
        n_moe = eng.experts.n_moe
    pieces = {}
    for layer, _ in spy.puts:
        pieces[layer] = pieces.get(layer, 0) + 1
    assert any(k > 1 for k in pieces.values()), f"every layer's copies went in one piece: {pieces}"
    by_layer: dict[int, list[int]] = {}
    for j, ex in spy.launched:
        by_layer.setdefault(j, []).extend(ex)
    assert any(copied_at_sync.get(j) for j in range(1, n_moe)), "no layer had blocks copied at its sync: untested"
    in_order = []
    for j in range(1, n_moe):            # (layer 0's blocks all come from the first guess or the sync)
        flags = [e in copied_at_sync.get(j, set()) for e in by_layer.get(j, [])]
        in_order.append(flags == sorted(flags))
    assert all(in_order) != twin, f"copied ahead first, by MoE layer from the second: {in_order}"

def test_launch_order_puts_the_copied_ahead_first():
    hits = {1: 10, 3: 11, 4: 12, 7: 13, 9: 14}
    assert ahead_flow.launch_order(hits, {4: 0, 9: 1}) == [(4, 12), (9, 14), (1, 10), (3, 11), (7, 13)]
    assert ahead_flow.launch_order(hits, {}) == list(hits.items())


def test_must_fail_flow_writing_slots_before_their_launch(tiny, refs, monkeypatch):
    """Must-fail twin: the flow told at the sync that every slot is free copies the next layer's blocks over this
    layer's before its launches read them (the CPU copies at once): the logits move. Launches of 4 experts, so that
    the flow's first copies (after a layer's first launch) meet slots that later launches read."""
    model_dir, store = tiny
    monkeypatch.setenv("MOESTREAM_PREFILL_LAUNCH_EXPERTS", "4")
    real_init = ahead_flow.AheadFlow.__init__

    def every_slot_free(self, slots, client, nj, ranked, free, *a, **kw):
        real_init(self, slots, client, nj, ranked, list(free) + [r for r in range(slots.n) if r not in free],
                  *a, **kw)
    monkeypatch.setattr(ahead_flow.AheadFlow, "__init__", every_slot_free)
    with _engine(store, model_dir, _all_experts(store)) as eng:
        run(eng, 300)
        out = run(eng, 300)
    assert (out - refs[300]).abs().max() > 1e-2


def test_flow_with_a_cache_of_one_layer_reads_each_block_once(tiny, monkeypatch):
    """The disk regime: a cache of one layer's experts, 1,500 tokens; only blocks in the slab are copied (pinned
    while copied), the misses go through the ring as they land, each routed block is read at most once, the logits
    are the in-memory engine's, no pin is left; and a layer that misses blocks starts no copies for the next layer
    before its misses (their staging copies would queue behind them on the bus)."""
    from cache_shm.client import CacheClient
    from expert_store.reader import ExpertStore
    model_dir, store = tiny
    seen, real_lookup, real_start = [], CacheClient.lookup, streaming.StreamingExperts._flow_start

    def lookup(client, layer, experts):
        got = real_lookup(client, layer, experts)
        seen.append(("lookup", layer, len(got) < len(experts)))
        return got

    def flow_start(src, j, nj, hits, ahead, g):
        seen.append(("flow", j, g is not None))
        return real_start(src, j, nj, hits, ahead, g)
    monkeypatch.setattr(CacheClient, "lookup", lookup)
    monkeypatch.setattr(streaming.StreamingExperts, "_flow_start", flow_start)
    st = ExpertStore.open(store)
    ids = prompt(1500, seed=4)
    m0 = NemotronH(model_dir)
    ref = prefill(m0, ids, m0.new_state())
    with _engine(store, model_dir, st.n_experts * st.block_stride) as eng:
        m = eng.model
        out = prefill(m, ids, m.new_state())
        last = eng.experts.prefill_acct.last
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    print(f"{last.blocks_read} blocks read, {last.distinct_experts} distinct, {last.ahead_copied} copied ahead, "
          f"{last.eager_copied} at the syncs")
    assert last.blocks_read <= last.distinct_experts + last.prefetch_wasted
    pairs = [(a, b) for a, b in zip(seen, seen[1:]) if b[0] == "flow"]
    assert pairs and all(a[0] == "lookup" and a[1] == b[1] for a, b in pairs)
    assert any(a[2] for a, _ in pairs), "no layer missed a block: the disk regime was not tested"
    assert not any(a[2] and b[2] for a, b in pairs), "a layer with misses started the next layer's copies early"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy streams and events need CUDA")
def test_gpu_flow_matches_the_cpu_engine(tiny):
    """On the GPU (bf16, staged, RAM; three runs): the flow's copies wait for the launches that read their slots; every
    routed block is read from the ahead slots, the logits are the CPU engine's."""
    kl, last, _ = gpu_prefills(tiny, runs=3)
    print(f"GPU flow: {last.ahead_copied} copied ahead, {last.ahead_used} used, {last.eager_copied} at the syncs; "
          f"KL {kl:.2e}")
    assert last.ahead_read == last.distinct_experts == last.ahead_used + last.eager_copied
    assert kl < 3e-3
