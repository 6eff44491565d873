"""The next MoE layer's experts copied ahead during a prefill (gpu_worker/prefill_experts.py `_copy_ahead`), on the CPU,
where the ahead slots are plain tensors and the copies are done at once: the blocks copied ahead are the ones the
next layer's launches read (a twin that puts a wrong block in a slot changes the logits), they were copied before
that layer's router synced (a twin that copies them after the sync is caught by the count), the wrong guesses are
counted, the logits are unchanged (RAM and a cache of 10 %), each routed block is still read at most once per
prompt, and the span model counts the slots without shortening a span."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from gpu_worker import prefill_experts, prefill_knobs, slab_copies
import gpu_worker.streaming as streaming
from gpu_worker.engine import StreamingEngine
from gpu_worker.generate import generate
from gpu_worker.prefill import (SpanPlan, ahead_bytes_for, launch_bytes_for, prefill, prefill_span, span_bytes,
                                span_plan)
from gpu_worker.sampling import SamplingParams
from nemotron.model import NemotronH
from tests.gpu_worker.test_prefill import prompt
from tests.gpu_worker.test_streaming_pipeline import make_store, tenth_of_experts


@pytest.fixture(scope="module")
def tiny(synth, tmp_path_factory):
    model_dir = synth("tiny", "nvfp4")
    return model_dir, make_store(model_dir, tmp_path_factory.mktemp("ahead-store") / "tiny")


@pytest.fixture(scope="module")
def refs(tiny):
    """The in-memory engine's last-token logits of the prompts the tests feed."""
    model_dir, _ = tiny
    m = NemotronH(model_dir)
    return {n: prefill(m, prompt(n, seed=n), m.new_state()) for n in (6, 300)}


def _all_experts(store) -> int:
    from expert_store.reader import ExpertStore
    st = ExpertStore.open(store)
    return len(st.moe_layers) * st.n_experts * st.block_stride + (1 << 20)


class CopySpy:
    """Records every layer's blocks copied ahead: [(MoE layer, experts)]."""

    def __init__(self, monkeypatch):
        self.copied, real = [], slab_copies.AheadSlots.copy

        def copy(slots, layer, experts, *a, **kw):
            self.copied.append((layer, list(experts)))
            return real(slots, layer, experts, *a, **kw)
        monkeypatch.setattr(slab_copies.AheadSlots, "copy", copy)


def staged_before_sync(src) -> bool:
    """Every MoE layer after the first of each span had blocks copied ahead when its router synced."""
    n_moe = src.n_moe
    later = [n for j, n in src.ahead_at_sync if j % n_moe != 0]
    return bool(later) and all(n > 0 for n in later)


def run(eng, n):
    m = eng.model
    return prefill(m, prompt(n, seed=n), m.new_state())


# The copies ahead's two schedules, each set explicitly: the default (one layer of slots: the next layer's guess
# copied after this layer's launches, this layer's other blocks staged through the ring) and eager + early copies (two
# layers of slots, both queued at the sync: gpu_worker/prefill_knobs.py `prefill_eager`, `ahead_early` follows it)
SCHEDULES = ["one_layer", "eager_early"]


def schedule(monkeypatch, name: str) -> None:
    monkeypatch.delenv("MOESTREAM_PREFILL_AHEAD_EARLY", raising=False)
    monkeypatch.delenv("MOESTREAM_PREFILL_AHEAD_LAYERS", raising=False)
    monkeypatch.setenv("MOESTREAM_PREFILL_EAGER", "1" if name == "eager_early" else "0")


def test_early_copies_follow_eager_ones(monkeypatch):
    """Eager copies are off by default, and early ones with them; MOESTREAM_PREFILL_EAGER=1 turns on the pair with two
    layers of slots (early copies alone are the combination that loses), and each can still be set apart."""
    for k in ("MOESTREAM_PREFILL_EAGER", "MOESTREAM_PREFILL_AHEAD_EARLY", "MOESTREAM_PREFILL_AHEAD_LAYERS"):
        monkeypatch.delenv(k, raising=False)
    assert not prefill_knobs.prefill_eager() and not prefill_knobs.ahead_early() and prefill_knobs.ahead_layers() == 1
    schedule(monkeypatch, "eager_early")
    assert prefill_knobs.prefill_eager() and prefill_knobs.ahead_early() and prefill_knobs.ahead_layers() == 2
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_EARLY", "0")
    assert prefill_knobs.prefill_eager() and not prefill_knobs.ahead_early()
    schedule(monkeypatch, "one_layer")
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_EARLY", "1")
    assert prefill_knobs.ahead_early() and not prefill_knobs.prefill_eager() and prefill_knobs.ahead_layers() == 1


@pytest.mark.parametrize("sched", SCHEDULES)
@pytest.mark.parametrize("n", [6, 300])
def test_blocks_copied_ahead_are_used_and_wrong_ones_counted(tiny, refs, n, sched, monkeypatch):
    schedule(monkeypatch, sched)
    model_dir, store = tiny
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_MIN_GUESS", "1")      # every guess copied: the wrong ones too
    spy = CopySpy(monkeypatch)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead = True
        src.ahead_min_tokens = 0      # (the default since session 15; set for the CPU path)
        run(eng, n)                      # reads every routed block once: the next run finds them all in RAM
        spy.copied.clear()
        out = run(eng, n)
        last = src.prefill_acct.last
        routed = src.prefill_acct.routed_keys()
        assert int(eng.sup.shm.slot_pins.sum()) == 0, "pins of the copies ahead were left behind"
    torch.testing.assert_close(out, refs[n], rtol=1e-5, atol=1e-4)
    copied = {(j, e) for j, ex in spy.copied for e in ex}
    print(f"{n} tokens: {last.ahead_copied} copied ahead, {last.ahead_used} used, {last.ahead_wrong} wrong; guess "
          f"precision {last.guess_right / max(last.guess_named, 1):.2f}, "
          f"recall {last.guess_right / max(last.guess_layer_routed, 1):.2f}")
    assert last.ahead_copied == len(copied) > 0 and last.bytes_copied_ahead == len(copied) * src.block_bytes
    assert last.ahead_used == len(copied & routed) > 0
    # (the slots are read by the blocks copied ahead and routed to, and by eager_early's eager copies)
    assert last.ahead_read == last.ahead_used + last.eager_copied, "a block copied ahead and routed to was not read"
    assert (last.eager_copied > 0) == (sched == "eager_early")
    assert last.ahead_wrong == len(copied - routed)
    assert last.ahead_copied == last.ahead_used + last.ahead_wrong      # RAM: nothing evicted in between
    assert staged_before_sync(src)
    assert last.guess_right <= min(last.guess_named, last.guess_layer_routed) and last.guess_named > 0
    if n == 6:     # a few tokens: the next router on this layer's input names experts the layer does not route to
        assert last.ahead_wrong > 0


def test_twin_copied_after_the_sync_is_caught(tiny, refs, monkeypatch):
    """Must-fail twin: layer j+1's blocks copied once its router has synced (the copy engine idle until then). The
    logits are right and the blocks are used, but the count at the sync is zero."""
    schedule(monkeypatch, "one_layer")   # (the schedule whose copies the twin moves; eager_early queues them at the sync)
    model_dir, store = tiny
    pending, real_copy, real_sync = [], streaming.StreamingExperts._copy_ahead, streaming.StreamingExperts._router_sync

    def late_copy(self, nj, g, counted=False):
        pending.append((nj, g.copy(), None, counted))

    def late_sync(self, counts, guess, overlap=None):
        host = real_sync(self, counts, guess, overlap)
        while pending:
            real_copy(self, *pending.pop())
        return host
    monkeypatch.setattr(streaming.StreamingExperts, "_copy_ahead", late_copy)
    monkeypatch.setattr(streaming.StreamingExperts, "_router_sync", late_sync)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead = True
        src.ahead_min_tokens = 0      # (the default since session 15; set for the CPU path)
        run(eng, 300)
        out = run(eng, 300)
        last = src.prefill_acct.last
    torch.testing.assert_close(out, refs[300], rtol=1e-5, atol=1e-4)
    assert last.ahead_read > 0
    assert not staged_before_sync(src)


def test_twin_wrong_block_in_a_slot_is_caught(tiny, refs, monkeypatch):
    """Must-fail twin: each block copied ahead lands in its neighbour's slot; the launches read the slots, so the
    logits move."""
    model_dir, store = tiny
    real = slab_copies.AheadSlots.copy

    def rotated(slots, layer, experts, sources, *a, **kw):
        return real(slots, layer, experts, sources[1:] + sources[:1], *a, **kw)
    monkeypatch.setattr(slab_copies.AheadSlots, "copy", rotated)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        eng.experts.copy_ahead = True
        eng.experts.ahead_min_tokens = 0      # (the default since session 15; set for the CPU path)
        run(eng, 300)
        out = run(eng, 300)
    assert (out - refs[300]).abs().max() > 1e-2


@pytest.mark.parametrize("sched", SCHEDULES)
def test_cache_at_a_tenth_with_copies_ahead(tiny, refs, sched, monkeypatch):
    """The disk regime: only blocks in the slab are copied ahead (pinned while copied); the logits are unchanged."""
    schedule(monkeypatch, sched)
    model_dir, store = tiny
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead = True
        src.ahead_min_tokens = 0      # (the default since session 15; set for the CPU path)
        out = run(eng, 300)
        stats = eng.cache_stats()
        last = src.prefill_acct.last
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    assert stats["evictions"] > 0
    torch.testing.assert_close(out, refs[300], rtol=1e-5, atol=1e-4)
    assert last.ahead_read == last.ahead_used + last.eager_copied and last.ahead_used <= last.ahead_copied


@pytest.mark.parametrize("sched", SCHEDULES)
def test_each_routed_block_read_at_most_once_with_copies_ahead(tiny, sched, monkeypatch):
    """A cache of one layer's experts and a 1,500-token prompt, copies ahead on: the blocks read from disk stay within
    the distinct experts routed plus the wasted prefetches (the pins of the copies ahead do not force re-reads)."""
    from expert_store.reader import ExpertStore
    schedule(monkeypatch, sched)
    model_dir, store = tiny
    st = ExpertStore.open(store)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=st.n_experts * st.block_stride, io_workers=2) as eng:
        eng.experts.copy_ahead = True
        eng.experts.ahead_min_tokens = 0      # (the default since session 15; set for the CPU path)
        m = eng.model
        prefill(m, prompt(1500, seed=4), m.new_state())
        last = eng.experts.prefill_acct.last
    print(f"{last.blocks_read} blocks read, {last.distinct_experts} distinct, {last.prefetch_wasted} wasted, "
          f"{last.ahead_copied} copied ahead, {last.eager_copied} eagerly")
    # (with a cache of one layer the next layer's blocks are rarely in the slab at this layer's sync: eager_early
    # copies them at their own layer's sync, eagerly)
    assert (last.ahead_copied if sched == "one_layer" else last.ahead_copied + last.eager_copied) > 0
    assert last.blocks_read <= last.distinct_experts + last.prefetch_wasted


# ------------------------------------------------------------------------------------------------ eager copies
class StageSpy:
    """Counts the blocks a prefill staged through the ring (the CPU path's `_blocks`, CUDA's `_stage`)."""

    def __init__(self, monkeypatch):
        self.staged = 0
        for name in ("_blocks", "_stage"):
            real = getattr(streaming.StreamingExperts, name)

            def spy(src, slots, *a, _real=real, **kw):
                self.staged += len(slots)
                return _real(src, slots, *a, **kw)
            monkeypatch.setattr(streaming.StreamingExperts, name, spy)


@pytest.mark.parametrize("n", [6, 300])
def test_eager_copies_take_every_hit_off_the_ring(tiny, refs, n, monkeypatch):
    """MOESTREAM_PREFILL_EAGER=1, RAM: every routed block is read from the ahead slots — copied ahead (the next
    layer's guess) or copied at its layer's sync (the rest, the first MoE layer's all) — none through the staging ring; the
    logits are unchanged and no pin is left."""
    monkeypatch.setenv("MOESTREAM_PREFILL_EAGER", "1")
    model_dir, store = tiny
    stage = StageSpy(monkeypatch)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead = True
        src.ahead_min_tokens = 0
        run(eng, n)
        stage.staged = 0
        out = run(eng, n)
        last = src.prefill_acct.last
        assert int(eng.sup.shm.slot_pins.sum()) == 0, "pins of the eager copies were left behind"
    torch.testing.assert_close(out, refs[n], rtol=1e-5, atol=1e-4)
    print(f"{n} tokens: {last.ahead_used} copied ahead and used, {last.eager_copied} eager, "
          f"{last.distinct_experts} routed")
    assert stage.staged == 0
    assert last.eager_copied > 0 and last.ahead_used + last.eager_copied == last.distinct_experts
    assert last.ahead_read == last.distinct_experts


def test_eager_copies_never_overwrite_the_layers_own_slots(tiny, refs, monkeypatch):
    """With fewer ahead slots than a layer's blocks plus the ones copied ahead for it, the eager copies stop at the
    first slot the layer still reads and the rest go through the ring: the logits are unchanged. Must-fail twin: the
    same copies told that no slot is taken overwrite blocks the layer's launches read."""
    monkeypatch.setenv("MOESTREAM_PREFILL_EAGER", "1")
    model_dir, store = tiny
    from expert_store.reader import ExpertStore
    st = ExpertStore.open(store)
    monkeypatch.setattr(prefill_experts, "PREFILL_AHEAD_SLOTS_MAX", max(2, st.n_experts // 2))
    outs, real = {}, slab_copies.AheadSlots.copy_now
    for twin in (False, True):
        if twin:
            monkeypatch.setattr(slab_copies.AheadSlots, "copy_now",
                                lambda a, ex, src, taken=frozenset(): real(a, ex, src, taken=frozenset()))
        stage = StageSpy(monkeypatch)
        with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
            src = eng.experts
            src.copy_ahead = True
            src.ahead_min_tokens = 0
            run(eng, 300)
            stage.staged = 0
            outs[twin] = run(eng, 300)
            last = src.prefill_acct.last
        if not twin:
            assert last.eager_copied > 0 and stage.staged > 0, "the slots were not short: nothing was tested"
    torch.testing.assert_close(outs[False], refs[300], rtol=1e-5, atol=1e-4)
    assert (outs[True] - refs[300]).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------ early copies ahead
@pytest.mark.parametrize("layers", ["1", "2"])
def test_early_copies_ahead_leave_the_layers_blocks_alone(tiny, refs, layers, monkeypatch):
    """MOESTREAM_PREFILL_AHEAD_EARLY=1: the next layer's copies ahead queued before this layer's launches, into slots
    this layer does not read (the CPU copies at once, so a copy into such a slot would change this layer's weights):
    the logits are unchanged, blocks were copied ahead before each later layer's sync and read from their slots, no
    pin is left. Must-fail twin (one layer of slots, where the next layer's copies wrap onto this layer's): the same
    copies told that no slot is taken overwrite this layer's blocks. With two layers of slots nothing wraps: the
    early copies are as many as the late ones would be."""
    monkeypatch.setenv("MOESTREAM_PREFILL_EAGER", "0")       # early copies alone (set apart from eager ones)
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_EARLY", "1")
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_LAYERS", layers)
    model_dir, store = tiny
    outs, real = {}, slab_copies.AheadSlots.copy
    for twin in (False, True) if layers == "1" else (False,):
        if twin:
            monkeypatch.setattr(slab_copies.AheadSlots, "copy",
                                lambda a, *args, taken=frozenset(), **kw: real(a, *args, **kw))
        with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
            src = eng.experts
            src.copy_ahead = True
            src.ahead_min_tokens = 0
            run(eng, 300)
            outs[twin] = run(eng, 300)
            last = src.prefill_acct.last
            assert int(eng.sup.shm.slot_pins.sum()) == 0, "pins of the early copies were left behind"
        if not twin:
            print(f"{layers} layer(s) of slots: {last.ahead_copied} copied early, {last.ahead_used} used")
            assert last.ahead_read == last.ahead_used > 0 and staged_before_sync(src)
    torch.testing.assert_close(outs[False], refs[300], rtol=1e-5, atol=1e-4)
    if layers == "1":
        assert (outs[True] - refs[300]).abs().max() > 1e-2
    else:
        monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_EARLY", "0")
        with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
            eng.experts.copy_ahead, eng.experts.ahead_min_tokens = True, 0
            run(eng, 300)
            run(eng, 300)
            assert eng.experts.prefill_acct.last.ahead_copied == last.ahead_copied


@pytest.mark.parametrize("switches", ["MOESTREAM_PREFILL_EAGER=1,MOESTREAM_PREFILL_AHEAD_EARLY=0",
                                      "MOESTREAM_PREFILL_AHEAD_EARLY=1,MOESTREAM_PREFILL_AHEAD_LAYERS=2",
                                      "MOESTREAM_PREFILL_EAGER=1"])    # (early copies follow eager ones)
def test_schedule_switches_with_a_cache_of_one_layer_read_each_block_once(tiny, switches, monkeypatch):
    """The disk regime under each schedule switch (eager copies, early copies ahead, both): a cache of one layer's
    experts, 1,500 tokens; misses still go through the ring as they land, each routed block is read at most once,
    the logits are the RAM engine's, no pin is left. (How many blocks were copied at the syncs depends on what the
    prefetch had landed by then: not asserted.)"""
    for kv in switches.split(","):
        monkeypatch.setenv(*kv.split("="))
    from expert_store.reader import ExpertStore
    model_dir, store = tiny
    st = ExpertStore.open(store)
    ids = prompt(1500, seed=4)
    m0 = NemotronH(model_dir)
    ref = prefill(m0, ids, m0.new_state())
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=st.n_experts * st.block_stride, io_workers=2) as eng:
        eng.experts.copy_ahead = True
        eng.experts.ahead_min_tokens = 0
        m = eng.model
        out = prefill(m, ids, m.new_state())
        last = eng.experts.prefill_acct.last
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    assert last.blocks_read <= last.distinct_experts + last.prefetch_wasted


# ------------------------------------------------------------------------------------------------ the span model
def test_ahead_slots_fit_beside_the_span_and_never_shorten_it(tiny):
    model_dir, _ = tiny
    cfg = NemotronH(model_dir).config
    dt, wish = torch.float32, 1 << 40
    for budget in (8 << 20, 64 << 20, 512 << 20):
        plan = span_plan(cfg, dt, budget)
        for cap in (100, 5000):
            span = prefill_span(cfg, dt, budget, cap=cap)
            ahead = ahead_bytes_for(cfg, dt, budget, span, plan, wish)
            with_ahead = dataclasses.replace(plan, ahead_bytes=ahead)
            grown = launch_bytes_for(cfg, dt, budget, span, with_ahead)
            full = dataclasses.replace(with_ahead, launch_bytes=grown)
            assert ahead > 0 and span_bytes(cfg, dt, span, plan=full) <= budget
            assert span_bytes(cfg, dt, span, plan=with_ahead) - span_bytes(cfg, dt, span, plan=plan) == ahead
            assert ahead_bytes_for(cfg, dt, budget, span, plan, 12345) == min(12345, ahead)
    # must-fail twin: the slots granted as wished, beside the span, break the budget
    span = prefill_span(cfg, dt, 64 << 20, cap=5000)
    assert span_bytes(cfg, dt, span, plan=SpanPlan(ahead_bytes=64 << 20)) > 64 << 20


def _lent_prompt(tiny, monkeypatch, lend: bool):
    """A 300-token prompt under a budget that leaves its ahead slots less than a layer's experts, on an engine whose
    VRAM tier (48 slots) was filled by decoding first, then decoding again: (the source's accounting of the prompt,
    the slots' buffers as the prompt made them, the tier after it, its logits, the tokens decoded before and after)."""
    schedule(monkeypatch, "one_layer")
    monkeypatch.setenv("MOESTREAM_PREFILL_LEND", "1" if lend else "0")
    monkeypatch.setenv("MOESTREAM_PREFILL_LEND_MIN_TOKENS", "0")
    made, real = [], slab_copies.AheadSlots.__init__

    def init(slots, *a, lent=None, **kw):
        made.append(lent)
        real(slots, *a, lent=lent, **kw)
    monkeypatch.setattr(slab_copies.AheadSlots, "__init__", init)
    model_dir, store = tiny
    from expert_store.reader import ExpertStore
    st = ExpertStore.open(store)
    dense = NemotronH(model_dir).dense_nbytes()
    ids = prompt(12, seed=7)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=1,
                         vram_bytes=dense + 48 * st.block_stride, vram_reserve_bytes=0) as eng:
        src, m, vt = eng.experts, eng.model, eng.experts.vram
        src.copy_ahead, src.ahead_min_tokens = True, 0
        before = [t.token for t in generate(eng, ids, SamplingParams(max_tokens=6))]
        residents, first, keys = len(vt.slot_of), len(made), set(vt.slot_of)
        out = prefill(m, prompt(300, seed=300), m.new_state(), budget_bytes=1 << 20)
        last, own = dataclasses.replace(src.prefill_acct.last), made[first:]      # (the prompt's own slots)
        keys_after = set(vt.slot_of)
        after = [t.token for t in generate(eng, ids, SamplingParams(max_tokens=6))]
        tier = dict(lent=vt.lent, free=len(vt.free), residents_before=residents, residents=len(vt.slot_of),
                    n=vt.n_slots, buf=vt.buf, keys_before=keys, keys_after_prompt=keys_after)
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    return last, own, tier, out, before, after


def test_a_long_prompt_borrows_its_ahead_slots_from_the_vram_tier_and_gives_them_back(tiny, refs, monkeypatch):
    """A prompt whose budget leaves its ahead slots less than a layer's experts borrows them from the VRAM tier
    (`VramTier.lend`: the coldest residents, at most half the tier): the slots are the tier's rows, the logits are
    the in-memory engine's, every lent row is back free at the prompt's end, and the decode after it (the tier
    refilling) gives the same tokens as before it. The twin (MOESTREAM_PREFILL_LEND=0) borrows nothing: its slots
    are a buffer of their own, the budget's share."""
    last, made, tier, out, before, after = _lent_prompt(tiny, monkeypatch, lend=True)
    assert tier["residents_before"] > tier["n"] // 2, "the decode before did not fill the tier: nothing to evict"
    assert last.ahead_lent == tier["n"] // 2 and 0 < last.lent_evicted <= last.ahead_lent
    assert made and all(lent is not None and lent[0] is tier["buf"] and len(lent[1]) == last.ahead_lent
                        for lent in made)
    assert last.ahead_copied > 0 and tier["lent"] == 0
    assert tier["free"] + tier["residents"] == tier["n"]
    # the residents the lend evicted are copied back at the prompt's end (the RAM cache holds every block)
    assert last.lent_restored == last.lent_evicted and tier["keys_after_prompt"] == tier["keys_before"]
    torch.testing.assert_close(out, refs[300], rtol=1e-5, atol=1e-4)
    assert after == before
    last, made, tier, out, before, after = _lent_prompt(tiny, monkeypatch, lend=False)
    assert last.ahead_lent == 0 and made and all(lent is None for lent in made) and tier["lent"] == 0
    torch.testing.assert_close(out, refs[300], rtol=1e-5, atol=1e-4)
    assert after == before


def test_streaming_source_wishes_one_layer_two_with_eager_and_none_zero_copy(tiny, monkeypatch):
    schedule(monkeypatch, "one_layer")
    model_dir, store = tiny
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=1) as eng:
        src = eng.experts
        assert src.ahead_wish() == 0, "on the CPU copies ahead are a test's choice"
        src.copy_ahead = True
        src.ahead_min_tokens = 0      # (the default since session 15; set for the CPU path)
        assert src.ahead_wish() == src.store.n_experts * src.store.block_stride
        schedule(monkeypatch, "eager_early")               # eager copies: two layers' slots
        assert src.ahead_wish() == 2 * src.store.n_experts * src.store.block_stride
        src._cuda = True                 # (the wish alone: nothing runs)
        src.prefill_weights = "zero_copy"
        assert src.ahead_wish() == 0
        src._cuda = False


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy streams and events need CUDA")
@pytest.mark.parametrize("runs", ["0", "1"])
def test_gpu_copies_ahead_read_by_the_next_layer(tiny, runs, monkeypatch):
    """On the GPU (bf16, staged weights, RAM): the blocks copied ahead on their own stream are read by the next
    layer's launches, copied before its router synced, and the logits are the CPU engine's; the A/B without them too.
    runs "1": the copies issued in runs with an event per group (MOESTREAM_AHEAD_RUNS)."""
    monkeypatch.setenv("MOESTREAM_AHEAD_RUNS", runs)
    from tests.nemotron.test_model_vs_transformers import mean_kl
    model_dir, store = tiny
    ids = prompt(700, seed=8)
    m0 = NemotronH(model_dir)
    ref = prefill(m0, ids, m0.new_state(), all_logits=True).numpy()
    got = {}
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2, device="cuda",
                         dtype=torch.bfloat16) as eng:
        src, m = eng.experts, eng.model
        for ahead in (True, False):
            src.copy_ahead = ahead
            src.ahead_min_tokens = 0      # (the default since session 15; set for the CPU path)
            prefill(m, ids, m.new_state())                  # every block in RAM for the timed-like second run
            out = prefill(m, ids, m.new_state(), all_logits=True)
            last = src.prefill_acct.last
            got[ahead] = (out.float().cpu().numpy(), last.ahead_read, last.ahead_used, last.ahead_copied,
                          last.ahead_wrong, staged_before_sync(src), last.eager_copied)
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    lm, read, used, copied, wrong, before, eager = got[True]
    print(f"GPU: {copied} copied ahead, {used} used, {wrong} wrong, {eager} eager; KL {mean_kl(ref, lm):.2e}")
    assert read == used + eager and used > 0 and copied == used + wrong and before
    assert mean_kl(ref, lm) < 3e-3 and mean_kl(ref, got[False][0]) < 3e-3
    assert got[False][1] == 0 and not got[False][5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy streams and events need CUDA")
def test_gpu_eager_copies_read_from_the_ahead_slots(tiny, monkeypatch):
    """On the GPU (bf16, staged, RAM), MOESTREAM_PREFILL_EAGER=1: every routed block read from the ahead slots (copied
    ahead or at its layer's sync, on the copies-ahead stream), nothing through the ring, the CPU engine's logits."""
    monkeypatch.setenv("MOESTREAM_PREFILL_EAGER", "1")
    from tests.nemotron.test_model_vs_transformers import mean_kl
    model_dir, store = tiny
    ids = prompt(700, seed=8)
    m0 = NemotronH(model_dir)
    ref = prefill(m0, ids, m0.new_state(), all_logits=True).numpy()
    stage = StageSpy(monkeypatch)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2, device="cuda",
                         dtype=torch.bfloat16) as eng:
        src, m = eng.experts, eng.model
        src.ahead_min_tokens = 0
        prefill(m, ids, m.new_state())
        stage.staged = 0
        out = prefill(m, ids, m.new_state(), all_logits=True).float().cpu().numpy()
        last = src.prefill_acct.last
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    print(f"GPU eager: {last.ahead_used} ahead, {last.eager_copied} eager of {last.distinct_experts}; "
          f"KL {mean_kl(ref, out):.2e}")
    assert stage.staged == 0 and last.eager_copied > 0
    assert last.ahead_read == last.distinct_experts == last.ahead_used + last.eager_copied
    assert mean_kl(ref, out) < 3e-3


def test_twin_without_the_restore_the_tier_comes_back_short(tiny, refs, monkeypatch):
    """MOESTREAM_PREFILL_LEND_RESTORE=0: the lent slots come back free and the evicted residents stay out until decode
    admits again (the check above would fail); the tokens are the same either way."""
    monkeypatch.setenv("MOESTREAM_PREFILL_LEND_RESTORE", "0")
    last, _, tier, out, before, after = _lent_prompt(tiny, monkeypatch, lend=True)
    assert last.lent_evicted > 0 and last.lent_restored == 0
    assert len(tier["keys_before"] - tier["keys_after_prompt"]) == last.lent_evicted
    torch.testing.assert_close(out, refs[300], rtol=1e-5, atol=1e-4)
    assert after == before


def test_must_fail_a_prompt_that_keeps_its_lent_slots_shrinks_the_tier(tiny, refs, monkeypatch):
    """The twin of the give-back check: a source that never gives the rows back leaves them lent, neither free nor
    resident, after the prompt (the check above would fail)."""
    monkeypatch.setattr(prefill_experts.PrefillExperts, "_give_back_lent", lambda self: None)
    last, _, tier, out, _, _ = _lent_prompt(tiny, monkeypatch, lend=True)
    assert last.ahead_lent > 0 and tier["lent"] == last.ahead_lent
    assert tier["free"] + tier["residents"] == tier["n"] - tier["lent"] < tier["n"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy streams and events need CUDA")
def test_gpu_a_long_prompt_borrows_the_vram_tiers_slots(tiny, monkeypatch):
    """On the GPU (bf16, staged, RAM, a VRAM tier of 48 slots filled by decoding): a prompt under a budget that leaves
    its ahead slots less than a layer's experts copies ahead into the tier's rows (half of them), reads them, gives
    them back, and its logits are the CPU engine's; the decode after it gives the tokens it gave before."""
    monkeypatch.setenv("MOESTREAM_PREFILL_LEND_MIN_TOKENS", "0")
    from tests.nemotron.test_model_vs_transformers import mean_kl
    ids, ref, eng = gpu_case(tiny)
    with eng:
        src, m = eng.experts, eng.model
        vt = src.vram = eng._vram_tier(torch.cuda.memory_allocated() + 48 * src.store.block_stride, 0, "cuda", 1)
        short = prompt(12, seed=7)
        before = [t.token for t in generate(eng, short, SamplingParams(max_tokens=8))]
        prefill(m, ids, m.new_state())
        residents = len(vt.slot_of)
        out = prefill(m, ids, m.new_state(), all_logits=True, budget_bytes=1 << 20).float().cpu().numpy()
        last = dataclasses.replace(src.prefill_acct.last)
        after = [t.token for t in generate(eng, short, SamplingParams(max_tokens=8))]
        assert int(eng.sup.shm.slot_pins.sum()) == 0 and vt.lent == 0
    print(f"GPU lent: {last.ahead_lent} slots ({last.lent_evicted} residents of {residents} evicted), "
          f"{last.ahead_read} blocks read from them; KL {mean_kl(ref, out):.2e}")
    assert last.ahead_lent == 24 and last.ahead_read > 0 and mean_kl(ref, out) < 3e-3 and after == before


def gpu_case(tiny):
    """A 700-token prompt, the CPU model's logits of its every token, and the RAM engine on the GPU (bf16, staged,
    copies ahead at every size) to enter."""
    model_dir, store = tiny
    ids = prompt(700, seed=8)
    m0 = NemotronH(model_dir)
    ref = prefill(m0, ids, m0.new_state(), all_logits=True).numpy()
    eng = StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2, device="cuda",
                          dtype=torch.bfloat16)
    eng.experts.ahead_min_tokens = 0
    return ids, ref, eng


def gpu_prefills(tiny, runs: int = 1):
    """The RAM engine on the GPU (bf16, staged) against the CPU model: a 700-token prompt prefilled once to fill the
    cache, then `runs` times with every token's logits. Returns (the largest mean KL against the CPU model, the last
    run's PromptCost, the source); asserts that no pin was left."""
    from tests.nemotron.test_model_vs_transformers import mean_kl
    ids, ref, eng = gpu_case(tiny)
    with eng:
        src, m = eng.experts, eng.model
        prefill(m, ids, m.new_state())
        outs = [prefill(m, ids, m.new_state(), all_logits=True).float().cpu().numpy() for _ in range(runs)]
        last = src.prefill_acct.last
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    return max(mean_kl(ref, o) for o in outs), last, src


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy streams and events need CUDA")
def test_gpu_early_copies_ahead(tiny, monkeypatch):
    """On the GPU (bf16, staged, RAM), early copies ahead with two layers of slots: read by the next layer, copied
    before its sync, the CPU engine's logits (early copies alone, set apart from eager ones)."""
    monkeypatch.setenv("MOESTREAM_PREFILL_EAGER", "0")
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_EARLY", "1")
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_LAYERS", "2")
    kl, last, src = gpu_prefills(tiny)
    print(f"GPU early: {last.ahead_copied} copied ahead, {last.ahead_used} used; KL {kl:.2e}")
    assert last.ahead_read == last.ahead_used > 0 and staged_before_sync(src)
    assert kl < 3e-3


# ------------------------------------------------------------------------------------------------ the first layer's guess
def _first_layer_at_sync(src) -> list[int]:
    return [n for j, n in src.ahead_at_sync if j == 0]


def test_first_layer_guess_copied_before_its_router(tiny, refs, monkeypatch):
    """After one prompt (the history), the next prompt's first MoE layer finds its most used experts copied ahead
    before its router synced, reads them from their slots, and the logits are unchanged; the guess names at most
    FIRST_GUESS_MIN_BLOCKS + FIRST_GUESS_BLOCKS_PER_1K per 1,000 tokens, the most used first (with the expected-count
    rule off: `test_first_guess_names_the_experts_expected_lam_tokens` has it on); no pin is left."""
    monkeypatch.setenv("MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED", "0")
    model_dir, store = tiny
    spy = CopySpy(monkeypatch)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead, src.ahead_min_tokens = True, 0
        run(eng, 300)                    # no history yet: no first-layer guess
        assert _first_layer_at_sync(src) == [0] and all(j != 0 for j, _ in spy.copied)
        before = src.prefill_acct.last   # its first copies ahead are MoE 1's, after MoE 0's sync: in sequence
        assert 0 < before.ms_to_inputs < before.ms_to_first_copy
        hist = src.route_hist[0].copy()
        spy.copied.clear()
        out = run(eng, 300)
        last = src.prefill_acct.last
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    torch.testing.assert_close(out, refs[300], rtol=1e-5, atol=1e-4)
    first = [ex for j, ex in spy.copied if j == 0]
    n = prefill_knobs.FIRST_GUESS_MIN_BLOCKS + 300 * prefill_knobs.FIRST_GUESS_BLOCKS_PER_1K // 1000
    assert len(first) == 1 and 0 < len(first[0]) <= n
    assert sorted(hist[first[0]], reverse=True) == sorted(hist[hist > 0], reverse=True)[:len(first[0])]
    assert _first_layer_at_sync(src)[0] == len(first[0])
    assert last.ahead_read == last.ahead_used + last.eager_copied and last.ahead_used > 0
    # the prompt's start: the inputs queued, then the first layer's guess copied, both timed from prefill()'s entry
    assert 0 < last.ms_to_inputs <= last.ms_to_first_copy
    # the host's figures nest: the launches inside the MoE steps, the staging inside the launches
    assert 0 <= last.ms_host_staging <= last.ms_host_launching <= last.ms_host_moe and last.ms_router_sync >= 0


def test_must_fail_first_layer_guess_of_unused_experts_is_counted_wrong(tiny, monkeypatch):
    """The twin: a history pointing at experts the first layer never routes to. Every block it copies is counted
    wrong and none is read (the accounting that says how good the guess was cannot be fooled)."""
    model_dir, store = tiny
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead, src.ahead_min_tokens = True, 0
        from bench.workdir import warm_all
        from expert_store.reader import ExpertStore
        warm_all(eng, ExpertStore.open(store))          # every block in the slab: the guess is only ever copied
        run(eng, 300)
        used = src.route_hist[0] > 0
        assert not used.all(), "the prompt used every expert of the first layer: nothing to point the twin at"
        twin = np.where(used, 0.0, 1.0)                   # only the experts this prompt does not route to
        monkeypatch.setenv("MOESTREAM_PREFILL_FIRST_GUESS", "0")
        run(eng, 300)                                     # the later layers' guesses alone, for the difference
        base = dataclasses.replace(src.prefill_acct.last)
        monkeypatch.delenv("MOESTREAM_PREFILL_FIRST_GUESS")
        src.route_hist[0] = twin
        run(eng, 300)
        last = src.prefill_acct.last
        layer0 = _first_layer_at_sync(src)[0]
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    assert layer0 > 0 and last.ahead_wrong - base.ahead_wrong == layer0
    assert last.ahead_used == base.ahead_used and last.ahead_read == base.ahead_read


def test_no_first_layer_guess_outside_a_prompt(tiny, monkeypatch):
    """A forward of several tokens that `prefill` did not start (no prompt open) copies nothing ahead for the first
    MoE layer, history or not: the slots would outlive it."""
    model_dir, store = tiny
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        src, m = eng.experts, eng.model
        src.copy_ahead, src.ahead_min_tokens = True, 0
        run(eng, 300)
        assert src.route_hist is not None and src.ahead_bytes > 0
        src.ahead_at_sync = []
        m.forward(prompt(40, seed=2), m.new_state())
        assert _first_layer_at_sync(src) == [0] and src.guess_first_layer(40) == 0


def test_first_layer_guess_off(tiny, monkeypatch):
    """MOESTREAM_PREFILL_FIRST_GUESS=0: the first MoE layer has nothing copied ahead at its sync, history or not."""
    monkeypatch.setenv("MOESTREAM_PREFILL_FIRST_GUESS", "0")
    model_dir, store = tiny
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead, src.ahead_min_tokens = True, 0
        run(eng, 300)
        run(eng, 300)
        assert src.route_hist is not None and all(n == 0 for n in _first_layer_at_sync(src))


def test_short_prompts_wish_no_slots(monkeypatch):
    """Copies ahead only for prompts of `ahead_min_tokens` and more (a gate of 2,048 until session 15, 0 since: every
    prompt); the wish is a layer's experts above the gate and nothing below it, and nothing where copy_ahead is off."""
    from gpu_worker.streaming import StreamingExperts
    from gpu_worker.prefill_knobs import PREFILL_AHEAD_MIN_TOKENS
    src = StreamingExperts.__new__(StreamingExperts)
    src.copy_ahead, src._cuda, src.prefill_weights, src.ahead_min_tokens = True, True, "staged", 2048
    src.store = type("S", (), {"n_experts": 8, "block_stride": 1000})()
    assert PREFILL_AHEAD_MIN_TOKENS == 0 or os.environ.get("MOESTREAM_PREFILL_AHEAD_MIN_TOKENS")
    schedule(monkeypatch, "one_layer")
    assert src.ahead_wish(2048) == 8 * 1000 and src.ahead_wish() == 8 * 1000
    assert src.ahead_wish(2047) == 0
    src.copy_ahead = False
    assert src.ahead_wish(4096) == 0


def _plan_ok(plan, runs, every) -> bool:
    """Every run once, in order, unsplit; each group but the last holds at least `every` blocks."""
    flat = [r for g in plan for r in g]
    sizes = [sum(k for _, k in g) for g in plan]
    return flat == list(runs) and all(s >= every for s in sizes[:-1]) and all(g for g in plan)


@pytest.mark.parametrize("every", [1, 3, 8])
def test_ahead_copy_plan_groups_runs_for_one_event_each(every):
    """The copies ahead in runs (on by default since session 9; MOESTREAM_AHEAD_RUNS=0 is off), an event per group of
    blocks."""
    from gpu_worker.slab_copies import ahead_copy_plan, ahead_runs
    rng = np.random.default_rng(every)
    lens = rng.integers(1, 6, size=37).tolist()
    runs, i = [], 0
    for k in lens:
        runs.append((i, k))
        i += k
    plan = ahead_copy_plan(runs, every)
    assert _plan_ok(plan, runs, every)
    assert len(plan) <= -(-i // every)                        # at most one event per `every` blocks (rounded up)
    assert ahead_copy_plan([], every) == []
    # must-fail twins of the check: a run split in two, a run dropped, a group too small before the last
    j = next(n for n, (_, k) in enumerate(runs) if k >= 2)
    (a, k) = runs[j]
    split = [[r] for r in runs[:j]] + [[(a, 1)], [(a + 1, k - 1)]] + [[r] for r in runs[j + 1:]]
    assert not _plan_ok(split, runs, 1)
    assert not _plan_ok(plan[:-1], runs, every)
    small = [[runs[0]], runs[1:]]                      # the first group: one run, shorter than `every` blocks
    assert _plan_ok(small, runs, every) == (runs[0][1] >= every)
    with pytest.raises(ValueError, match="every"):
        ahead_copy_plan(runs, 0)
    assert ahead_runs() == (os.environ.get("MOESTREAM_AHEAD_RUNS") != "0")     # on unless turned off


@pytest.mark.parametrize("most", [0, 1, 3, 8])
def test_split_runs_cut_long_runs_in_order(most):
    """The copies ahead in runs of at most `most` blocks (MOESTREAM_AHEAD_RUN_MAX): every block once, in order, no
    piece longer than `most` (0: the runs as they are); then grouped for events as before. Must-fail twin: a layer in
    one run (the RAM regime's slab) left whole is one copy with one event."""
    from gpu_worker.slab_copies import ahead_copy_plan, split_runs
    runs = [(0, 20), (20, 1), (21, 7), (28, 9)]
    got = split_runs(runs, most)
    flat = [i + q for i, n in got for q in range(n)]
    assert flat == list(range(37))
    if most:
        assert max(n for _, n in got) <= most and len(got) >= len(runs)
        assert all(len(g) >= 1 for g in ahead_copy_plan(got, 8))
        assert len(ahead_copy_plan(split_runs([(0, 415)], most), 8)) >= 415 // 15      # groups of < 8 + most
    else:
        assert got == runs
        assert len(ahead_copy_plan([(0, 415)], 8)) == 1


class GuessSpy:
    """Records the next layers' guesses handed to `_copy_ahead`: [(MoE layer, tokens per expert)], counted ones only."""

    def __init__(self, monkeypatch):
        self.guesses, real = [], streaming.StreamingExperts._copy_ahead

        def copy_ahead(src, nj, g, taken=None, counted=False):
            if counted:
                self.guesses.append((nj, np.asarray(g).copy()))
            return real(src, nj, g, taken, counted)
        monkeypatch.setattr(streaming.StreamingExperts, "_copy_ahead", copy_ahead)


def _guessed_and_copied(tiny, monkeypatch, n: int, least: int | None):
    """One prompt of n tokens after a first one (the blocks in RAM), with MOESTREAM_PREFILL_AHEAD_MIN_GUESS=least
    (None: unset); returns (its logits, the next layers' guesses, the blocks copied ahead, the prompt's cost, the
    (layer, expert) pairs it routed to)."""
    model_dir, store = tiny
    if least is None:
        monkeypatch.delenv("MOESTREAM_PREFILL_AHEAD_MIN_GUESS", raising=False)
    else:
        monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_MIN_GUESS", str(least))
    monkeypatch.setenv("MOESTREAM_PREFILL_FIRST_GUESS", "0")     # the next layers' guesses alone
    copies, guesses = CopySpy(monkeypatch), GuessSpy(monkeypatch)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead, src.ahead_min_tokens = True, 0
        run(eng, n)
        copies.copied.clear()
        guesses.guesses.clear()
        out = run(eng, n)
        last = dataclasses.replace(src.prefill_acct.last)
        routed = src.prefill_acct.routed_keys()
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    return out, guesses.guesses, copies.copied, last, routed


def _copied_below(guesses, copied, least: int) -> int:
    """Blocks copied ahead for an expert that the guess sent fewer than `least` tokens."""
    g = dict(guesses)
    return sum(1 for j, ex in copied for e in ex if g[j][e] < least)


@pytest.mark.parametrize("least", [None, 3])
def test_min_guess_copies_only_experts_guessed_that_many_tokens(tiny, refs, least, monkeypatch):
    """The default (AHEAD_MIN_GUESS, 2) and MOESTREAM_PREFILL_AHEAD_MIN_GUESS=3 on 6 tokens (most guesses one token): no
    block is copied ahead for an expert the next layer's router sent fewer tokens, some are copied, the logits are
    unchanged. The accounting's buckets hold every expert the guesses named, and the right ones are those the layer
    routed to."""
    out, guesses, copied, last, routed = _guessed_and_copied(tiny, monkeypatch, 6, least)
    m = prefill_knobs.AHEAD_MIN_GUESS if least is None else least
    assert m >= 2
    torch.testing.assert_close(out, refs[6], rtol=1e-5, atol=1e-4)
    assert copied and _copied_below(guesses, copied, m) == 0
    from gpu_worker.prefill_accounting import GUESS_TOKEN_BUCKETS

    def guess_bucket(tokens: int) -> int:      # the buckets' reference: the largest lower edge at most `tokens`
        return max(b for b in GUESS_TOKEN_BUCKETS if tokens >= b)
    named = {b: 0 for b in GUESS_TOKEN_BUCKETS}
    right = dict(named)
    for j, g in guesses:
        for e in np.flatnonzero(g > 0).tolist():
            named[guess_bucket(int(g[e]))] += 1
            right[guess_bucket(int(g[e]))] += (j, e) in routed
    assert named[1] > 0 and sum(named.values()) == last.guess_named
    assert {b: getattr(last, f"guess_named_t{b}") for b in GUESS_TOKEN_BUCKETS} == named
    assert {b: getattr(last, f"guess_right_t{b}") for b in GUESS_TOKEN_BUCKETS} == right
    p = last.guess_precision_by_tokens()
    assert list(p) == ["1", "2", "3-4", "5+"] and p["1"] == right[1] / named[1]


def test_must_fail_min_guess_one_copies_one_token_guesses(tiny, refs, monkeypatch):
    """The twin: MOESTREAM_PREFILL_AHEAD_MIN_GUESS=1 (every guessed expert copied, as before session 17) copies blocks
    for experts guessed one token in the same prompt, so the check above can fail."""
    out, guesses, copied, _, _ = _guessed_and_copied(tiny, monkeypatch, 6, 1)
    torch.testing.assert_close(out, refs[6], rtol=1e-5, atol=1e-4)
    assert _copied_below(guesses, copied, 2) > 0


def test_min_guess_knob_refuses_nonsense(monkeypatch):
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_MIN_GUESS", "0")
    with pytest.raises(ValueError, match="MOESTREAM_PREFILL_AHEAD_MIN_GUESS"):
        prefill_knobs.ahead_min_guess()
    monkeypatch.setenv("MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED", "-1")
    with pytest.raises(ValueError, match="MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED"):
        prefill_knobs.first_guess_expected()


@pytest.mark.parametrize("lam", [0.0, 4.0])
def test_first_guess_names_the_experts_expected_lam_tokens(tiny, refs, lam, monkeypatch):
    """MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED=4: the first MoE layer's guess names every expert the history expects 4
    or more of the prompt's 300 tokens at (more than the fixed count of 11 here), the most used first; 0 (off, the
    twin): the fixed count. The logits are unchanged either way."""
    monkeypatch.setenv("MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED", str(lam))
    model_dir, store = tiny
    spy = CopySpy(monkeypatch)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.copy_ahead, src.ahead_min_tokens = True, 0
        run(eng, 300)
        hist = src.route_hist[0].copy()
        spy.copied.clear()
        out = run(eng, 300)
        assert int(eng.sup.shm.slot_pins.sum()) == 0
    torch.testing.assert_close(out, refs[300], rtol=1e-5, atol=1e-4)
    first = [ex for j, ex in spy.copied if j == 0]
    fixed = prefill_knobs.FIRST_GUESS_MIN_BLOCKS + 300 * prefill_knobs.FIRST_GUESS_BLOCKS_PER_1K // 1000
    expected = int(np.count_nonzero(hist * 300 >= 4.0))
    assert expected > fixed, "the history expects too few experts for the knob to name more than the fixed count"
    assert len(first) == 1
    assert len(first[0]) == (expected if lam else fixed)
    assert sorted(hist[first[0]], reverse=True) == sorted(hist[hist > 0], reverse=True)[:len(first[0])]


def test_guess_buckets_count_by_tokens_and_a_shifted_edge_is_caught():
    """PromptCost.count_guesses on known guesses: 1, 2, 3-4 and 5+ guessed tokens, right or not; the twin (the edges
    searched from the left, so an expert guessed exactly 2 tokens falls in the 1-token bucket) gives other counts."""
    from gpu_worker.prefill_accounting import GUESS_TOKEN_BUCKETS, PromptCost
    tokens = [1, 1, 2, 3, 4, 5, 9, 2]
    right = [True, False, True, True, False, True, True, False]
    c = PromptCost()
    c.count_guesses(tokens, right)
    got = {b: (getattr(c, f"guess_named_t{b}"), getattr(c, f"guess_right_t{b}")) for b in GUESS_TOKEN_BUCKETS}
    assert got == {1: (2, 1), 2: (2, 1), 3: (2, 1), 5: (2, 2)}
    assert c.guess_precision_by_tokens() == {"1": 0.5, "2": 0.5, "3-4": 0.5, "5+": 1.0}
    at = np.searchsorted(GUESS_TOKEN_BUCKETS, tokens, side="left") - 1          # the twin's edges
    twin = {b: int((at == i).sum()) for i, b in enumerate(GUESS_TOKEN_BUCKETS)}
    assert twin != {b: n for b, (n, _) in got.items()}


def test_ahead_first_knob(monkeypatch):
    """MOESTREAM_PREFILL_AHEAD_FIRST: on by default (session 28's GPU A/B), 0 off, anything else named."""
    monkeypatch.delenv("MOESTREAM_PREFILL_AHEAD_FIRST", raising=False)
    assert prefill_knobs.ahead_first()
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_FIRST", "0")
    assert not prefill_knobs.ahead_first()
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_FIRST", "yes")
    with pytest.raises(ValueError, match="MOESTREAM_PREFILL_AHEAD_FIRST"):
        prefill_knobs.ahead_first()


@pytest.mark.parametrize("first", [True, False])
def test_ahead_first_launches_the_copied_blocks_first(tiny, refs, first, monkeypatch):
    """MOESTREAM_PREFILL_AHEAD_FIRST=1 (the one-layer schedule): in a MoE layer whose blocks were partly copied ahead,
    the experts copied ahead launch before those staged through the ring, and the logits are unchanged. The first MoE
    layer's guess is held to its fixed count (11 of the ~32 experts 300 tokens route to), so that layer has both kinds.
    Must-fail twin (off): the launches in expert order, caught by the order check."""
    schedule(monkeypatch, "one_layer")
    model_dir, store = tiny
    monkeypatch.setenv("MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED", "0")
    monkeypatch.setenv("MOESTREAM_PREFILL_LAUNCH_EXPERTS", "4")
    monkeypatch.setenv("MOESTREAM_PREFILL_AHEAD_FIRST", "1" if first else "0")
    launched, before = [], {}
    real_batch, real_settle = streaming.StreamingExperts._prefill_batch, streaming.StreamingExperts._ahead_settle

    def batch(src, lay, b, *a, **kw):
        launched.append((lay.j, [e for e, _ in b]))
        return real_batch(src, lay, b, *a, **kw)

    def settle(src, j, *a, **kw):
        got = real_settle(src, j, *a, **kw)
        if j is not None:
            before[j] = set(got)
        return got
    monkeypatch.setattr(streaming.StreamingExperts, "_prefill_batch", batch)
    monkeypatch.setattr(streaming.StreamingExperts, "_ahead_settle", settle)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=_all_experts(store), io_workers=2) as eng:
        eng.experts.copy_ahead, eng.experts.ahead_min_tokens = True, 0     # (the CPU path copies ahead only if told)
        run(eng, 300)                    # the routes the first MoE layer's guess is made from
        launched.clear()
        before.clear()
        out = run(eng, 300)
    torch.testing.assert_close(out, refs[300], rtol=1e-5, atol=1e-4)
    by_layer: dict[int, list[int]] = {}
    for j, ex in launched:
        by_layer.setdefault(j, []).extend(ex)
    flags = {j: [e in before.get(j, set()) for e in ex] for j, ex in by_layer.items()}
    mixed = {j: f for j, f in flags.items() if any(f) and not all(f)}
    assert mixed, f"no MoE layer launched both blocks copied ahead and staged ones: untested ({flags})"
    assert all(f == sorted(f, reverse=True) for f in mixed.values()) == first, mixed
