"""The one prefill loop, layer-major: the whole tail through each layer before the next, split only where the
memory budget forces it. It equals the old 512-token chunked prefill and transformers, with images and with a
cache of 10 % of the experts; each routed (layer, expert) is read at most once per prompt (a twin that re-reads
per chunk is caught); a cancel stops it within one layer."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

import nemotron.attention as attention
from gpu_worker.engine import StreamingEngine
from gpu_worker.generate import generate
from gpu_worker.prefill import ImageRows, prefill, prefill_span, span_bytes, span_plan
from gpu_worker.sampling import SamplingParams
from nemotron.model import NemotronH
from tests.gpu_worker.test_streaming_pipeline import make_store, tenth_of_experts
from tests.nemotron.test_model_vs_transformers import KL_MAX, mean_kl, reference
from tools import logits as logits_tool

OLD_CHUNK = 512
N_GREEDY = 6


def prompt(n, seed=0, vocab=1000):
    return [int(t) for t in np.random.default_rng(seed).integers(14, vocab, size=n)]


@pytest.fixture(scope="module")
def tiny(synth, tmp_path_factory):
    model_dir = synth("tiny", "nvfp4")
    return model_dir, make_store(model_dir, tmp_path_factory.mktemp("prefill-store") / "tiny")


class ForwardSpy:
    """Counts forward calls and their token counts."""

    def __init__(self, model, monkeypatch):
        self.calls, orig = [], model.forward

        def fwd(ids, state, *a, **kw):
            self.calls.append(len(ids))
            return orig(ids, state, *a, **kw)
        monkeypatch.setattr(model, "forward", fwd)


# ------------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("quant", ["nvfp4", "mixed"])
def test_layer_major_equals_chunked_and_transformers(synth, tmp_path, quant, monkeypatch):
    model_dir = synth("tiny", quant)
    engine = NemotronH(model_dir)
    ids = prompt(2 * OLD_CHUNK + 77, seed=1)          # three old chunks
    # small score blocks, so that attention over the tail runs in many query blocks against the reference too
    monkeypatch.setattr(attention, "SCORE_BYTES", 1 << 20)
    assert attention.query_block(engine.config.num_attention_heads, len(ids), len(ids), 4) < len(ids) // 10
    spy = ForwardSpy(engine, monkeypatch)
    lm, lm_greedy, lm_gl = logits_tool.logits_and_greedy(engine, ids, N_GREEDY)
    assert spy.calls[0] == len(ids), "the whole tail in one forward"
    ch, ch_greedy, _ = logits_tool.logits_and_greedy(engine, ids, N_GREEDY, prefill_chunk=OLD_CHUNK)
    ref, ref_greedy, _ = reference(model_dir, ids, N_GREEDY, tmp_path)
    np.testing.assert_allclose(lm, ch, rtol=1e-4, atol=1e-4)
    assert mean_kl(ch, lm) < 1e-6 and mean_kl(ref, lm) < KL_MAX
    np.testing.assert_array_equal(lm_greedy, ch_greedy)
    np.testing.assert_array_equal(lm_greedy, ref_greedy)
    assert np.array_equal(lm_gl.argmax(-1), lm_greedy)


def test_streaming_layer_major_with_cache_at_a_tenth(tiny):
    model_dir, store = tiny
    ids = prompt(2 * OLD_CHUNK + 40, seed=2)
    ref, ref_greedy, _ = logits_tool.logits_and_greedy(NemotronH(model_dir), ids, N_GREEDY)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        lm, greedy, _ = logits_tool.logits_and_greedy(eng.model, ids, N_GREEDY)
        pf = eng.experts.prefill_acct.totals()
        stats = eng.cache_stats()
    assert stats["evictions"] > 0
    # the reference is the in-memory engine, whose layer-major prefill equals the chunked one (test above)
    np.testing.assert_allclose(lm, ref, rtol=1e-5, atol=1e-4)
    assert mean_kl(ref, lm) < 1e-6
    np.testing.assert_array_equal(greedy, ref_greedy)
    assert pf["prefill_prompts"] == 1 and pf["prefill_tokens"] == len(ids)
    assert pf["prefill_last_distinct_experts"] <= 4 * 32 and pf["prefill_last_blocks_read"] > 0


def test_image_prompt_layer_major_equals_chunked(tmp_path, monkeypatch):
    from tests.nemotron.test_vision_e2e import MESSAGES
    from tools.synth_vision import synthesize_omni
    omni = tmp_path / "omni"
    synthesize_omni(omni, seed=5)
    ids, embeds, positions = logits_tool.image_inputs(omni, MESSAGES["two"])
    engine = NemotronH(omni)
    spy = ForwardSpy(engine, monkeypatch)
    lm, lm_greedy, _ = logits_tool.logits_and_greedy(engine, ids, N_GREEDY, 0, embeds, positions)
    assert spy.calls[0] == len(ids)
    ch, ch_greedy, _ = logits_tool.logits_and_greedy(engine, ids, N_GREEDY, 37, embeds, positions)
    assert sum(1 for c in spy.calls if c > 1) > 2, "the chunked run spans several chunks"
    np.testing.assert_allclose(lm, ch, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(lm_greedy, ch_greedy)
    # must-fail twin: the images one position late change the logits
    bad, _, _ = logits_tool.logits_and_greedy(engine, ids, 0, 0, embeds, positions + 1)
    assert mean_kl(lm, bad) > 100 * KL_MAX


# ------------------------------------------------------------------------------------------------ budget
def test_budget_splits_only_when_it_must(tiny, monkeypatch):
    model_dir, _ = tiny
    engine = NemotronH(model_dir)
    cfg, ids = engine.config, prompt(700, seed=3)
    sizes = [span_bytes(cfg, torch.float32, t) for t in (1, 10, 100, 700)]
    assert sizes == sorted(sizes)
    spy = ForwardSpy(engine, monkeypatch)
    whole = prefill(engine, ids, engine.new_state(), budget_bytes=span_bytes(cfg, torch.float32, len(ids)))
    assert spy.calls == [len(ids)]
    spy.calls.clear()

    # a budget that holds the prompt's last 30 tokens beside the KV rows of all before them: the earlier spans,
    # whose KV rows are fewer, are longer (the plan follows the budget, so a few rounds settle it)
    past, n_attn = len(ids) - 30, cfg.layer_types.count("attention")
    budget = span_bytes(cfg, torch.float32, 30, past, kv_rows=[past] * n_attn)
    for _ in range(3):
        budget = span_bytes(cfg, torch.float32, 30, past, plan=span_plan(cfg, torch.float32, budget),
                            kv_rows=[past] * n_attn)
    plan = span_plan(cfg, torch.float32, budget)
    st, caps = engine.new_state(), []
    spans_at = prefill_span.__globals__["prefill_span"]

    def span_seen(*a, **kw):    # the KV capacities each span was planned with
        caps.append(kw.get("kv_rows"))
        return spans_at(*a, **kw)
    monkeypatch.setattr("gpu_worker.prefill.prefill_span", span_seen)
    split = prefill(engine, ids, st, budget_bytes=budget)
    assert len(spy.calls) >= 3 and sum(spy.calls) == len(ids) == st.position
    past = 0
    for n, rows in zip(spy.calls, caps):    # each span the longest the budget allows, and within it
        assert span_bytes(cfg, torch.float32, n, past, plan=plan, kv_rows=rows) <= budget
        assert n == spans_at(cfg, torch.float32, budget, past, cap=len(ids) - past, kv_rows=rows)
        past += n
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ reads
def _one_layer_cache(store) -> int:
    from expert_store.reader import ExpertStore
    st = ExpertStore.open(store)
    return st.n_experts * st.block_stride


def _stats(model_dir, store, ids, tmp_path, chunk: int) -> dict:
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    out = tmp_path / f"stats-{chunk}.json"
    mb = _one_layer_cache(store) / 2**20
    assert logits_tool.main(["--model", str(model_dir), "--store", str(store), "--cache-mb", str(mb),
                             "--ids-file", str(tmp_path / "ids.json"), "--out", str(tmp_path / "o.npz"),
                             "--prefill-chunk", str(chunk), "--stats-json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("chunk", [0, OLD_CHUNK])
def test_each_routed_expert_read_at_most_once_per_prompt(tiny, tmp_path, chunk):
    """A cache of one layer's experts and a 1,500-token prompt: layer-major reads each routed (layer, expert)
    at most once; the twin, chunked as before, re-reads them per chunk and must be caught."""
    model_dir, store = tiny
    s = _stats(model_dir, store, prompt(1500, seed=4), tmp_path, chunk)
    for key in ("prefill_blocks_read", "prefill_distinct_experts", "prefill_prefetch_wasted", "prefill_tokens",
                "prefill_bytes_from_disk", "prefill_tokens_per_s", "cache", "decode"):
        assert key in s
    bound = s["prefill_distinct_experts"] + s["prefill_prefetch_wasted"]
    print(f"chunk {chunk}: {s['prefill_blocks_read']} blocks read, {s['prefill_distinct_experts']} distinct, "
          f"{s['prefill_prefetch_wasted']} wasted prefetches")
    assert s["prefill_tokens"] == 1500 and s["prefill_distinct_experts"] > 0
    if chunk == 0:
        assert s["prefill_blocks_read"] <= bound
        assert s["cache"]["prefetch_issued"] > 0, "the next layer's experts were not requested ahead"
    else:
        assert s["prefill_blocks_read"] > bound


# ------------------------------------------------------------------------------------------------ cancel
def _cancel_after_layer(model, n: int, cancel, ran: list, monkeypatch):
    """Wrap every mixer: record the layers that run (once per call: a layer runs a piece per call), set `cancel`
    once layer n has run."""
    def wrap(i, m):
        def wrapped(*a):
            out = m(*a)
            ran.append(i)
            if i == n:
                cancel.set()
            return out
        return wrapped
    monkeypatch.setattr(model, "mixers", [wrap(i, m) for i, m in enumerate(model.mixers)])


def test_cancel_stops_a_long_prefill_within_one_layer(tiny, monkeypatch):
    model_dir, store = tiny
    ids = prompt(600, seed=6)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        m = eng.model
        ref = prefill(m, ids, m.new_state())
        cancel, ran = threading.Event(), []
        st = m.new_state()
        with monkeypatch.context() as mp:
            _cancel_after_layer(m, 1, cancel, ran, mp)
            assert prefill(m, ids, st, cancel=cancel) is None
            # a layer runs in pieces (one call each) and the layers in order: none after layer 1
            assert ran == sorted(ran) and set(ran) == {0, 1}, f"layers ran after the cancel: {ran}"
            assert st.position == 0, "a state part-way through a call was kept"
            assert list(generate(m, ids, SamplingParams(max_tokens=3), cancel=cancel)) == []
        assert int(eng.sup.shm.slot_pins.sum()) == 0, "the cancelled prefill left pins behind"
        again = prefill(m, ids, m.new_state())
    torch.testing.assert_close(again, ref, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped kernels and both weight paths need CUDA")
@pytest.mark.parametrize("path", ["staged", "zero_copy"])
def test_gpu_layer_major_both_weight_paths(tiny, path):
    """On the GPU (bf16), through the grouped launches with the weights staged into the device ring or read
    zero-copy from the slab: the CPU engine's logits (fp32), layer-major and chunked alike."""
    model_dir, store = tiny
    ids = prompt(2 * OLD_CHUNK + 40, seed=7)
    ref, ref_greedy, _ = logits_tool.logits_and_greedy(NemotronH(model_dir), ids, 2)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=2,
                         device="cuda", dtype=torch.bfloat16) as eng:
        eng.experts.prefill_weights = path
        lm, greedy, _ = logits_tool.logits_and_greedy(eng.model, ids, 2)
        launches = eng.experts.prefill_acct.last.launches
        ahead = eng.experts.prefill_acct.last
        ahead_read, ahead_used, ahead_at_sync = ahead.ahead_read, ahead.ahead_used, list(eng.experts.ahead_at_sync)
        eager = ahead.eager_copied
        ch, _, _ = logits_tool.logits_and_greedy(eng.model, ids, 2, prefill_chunk=OLD_CHUNK)
    kl, kl_ch = mean_kl(ref, lm), mean_kl(ref, ch)
    print(f"{path}: mean KL vs the CPU engine {kl:.2e} (chunked {kl_ch:.2e}), {launches} grouped launches")
    assert kl < 3e-3 and kl_ch < 3e-3
    assert greedy[0] == ref_greedy[0]
    assert launches < 4 * 32, "one launch per expert: the grouping did not happen"
    print(f"{path}: {ahead_read} blocks read from the copies ahead; at each router's sync {ahead_at_sync}")
    # staged: what was copied ahead and routed to was read from the slots (how much of it, a cache of 10 % decides:
    # test_prefill_ahead.py's GPU test has the RAM regime), and so were any eager copies (MOESTREAM_PREFILL_EAGER);
    # zero-copy copies nothing ahead
    assert ahead_read == ahead_used + eager and (path == "staged" or ahead_read == 0)
