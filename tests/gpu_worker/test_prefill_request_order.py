"""Where a MoE layer's prefill request goes (gpu_worker/prefill_experts.py `_prefill`): with every routed block in the
cache, after the layer's first launch (the launch waits for nothing it does not need: the request's post wakes the
prefetcher, ~0.4 ms of host on the VM); with a block missing, before the layer's launches (the disk reads start with
it). Each order is the other's must-fail twin: one engine, two regimes, opposite assertions. The logits are the
in-memory engine's, and the guess is still judged (the judging moved with the request)."""
from __future__ import annotations

import torch

import gpu_worker.streaming as streaming
from cache_shm.client import CacheClient
from expert_store.reader import ExpertStore
from gpu_worker.engine import StreamingEngine
from gpu_worker.prefill import prefill
from nemotron.model import NemotronH
from tests.gpu_worker.test_prefill import prompt
from tests.gpu_worker.test_prefill_ahead import _all_experts, tiny  # noqa: F401


def _events(monkeypatch):
    seen = []
    real_req, real_batch = CacheClient.request_prefill, streaming.StreamingExperts._prefill_batch
    real_lookup = CacheClient.lookup

    def request_prefill(client, layer, experts, *a, **kw):
        seen.append(("request", layer))
        return real_req(client, layer, experts, *a, **kw)

    def batch(src, lay, b, *a, **kw):
        seen.append(("launch", lay.j))
        return real_batch(src, lay, b, *a, **kw)

    def lookup(client, layer, experts):
        got = real_lookup(client, layer, experts)
        seen.append(("lookup", layer, len(got) < len(experts)))
        return got
    monkeypatch.setattr(CacheClient, "request_prefill", request_prefill)
    monkeypatch.setattr(streaming.StreamingExperts, "_prefill_batch", batch)
    monkeypatch.setattr(CacheClient, "lookup", lookup)
    return seen


def _layers(seen):
    """Per MoE layer's lookup: (missed a block, the kinds of the events up to the next lookup, in order)."""
    out, cur = [], None
    for ev in seen:
        if ev[0] == "lookup":
            cur = (ev[2], [])
            out.append(cur)
        elif cur is not None:
            cur[1].append(ev[0])
    return out


def test_request_after_the_first_launch_in_ram_before_the_launches_on_misses(tiny, monkeypatch):
    model_dir, store = tiny
    seen = _events(monkeypatch)
    st = ExpertStore.open(store)
    ids = prompt(1500, seed=4)
    m0 = NemotronH(model_dir)
    ref = prefill(m0, ids, m0.new_state())
    for regime, cache in (("ram", _all_experts(store)), ("disk", st.n_experts * st.block_stride)):
        with StreamingEngine(store, model_dir=model_dir, cache_bytes=cache, io_workers=2) as eng:
            eng.experts.copy_ahead, eng.experts.ahead_min_tokens = True, 0
            m = eng.model
            if regime == "ram":
                prefill(m, ids, m.new_state())       # every block in the cache for the run that counts
            seen.clear()
            out = prefill(m, ids, m.new_state())
            last = eng.experts.prefill_acct.last
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
        layers = _layers(seen)
        assert layers and 0 < last.guess_right <= min(last.guess_named, last.guess_layer_routed)
        for missed, kinds in layers:
            assert kinds.count("request") == 1
            assert not (missed and regime == "ram"), "the RAM run missed a block"
            if missed:
                assert kinds.index("request") < kinds.index("launch"), "a layer with misses launched before its request"
            else:
                assert kinds.index("launch") < kinds.index("request"), f"{regime}: the request held the launch back"
        if regime == "disk":
            assert any(missed for missed, _ in layers), "no layer missed a block: the disk order was not tested"
