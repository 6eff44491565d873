"""The full multi-process pipeline (prefetcher, IO workers, shared slab) gives the engine's exact output,
with a cache small enough to force eviction and misses."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker.engine import StreamingEngine
from gpu_worker.generate import generate
from gpu_worker.sampling import SamplingParams
from nemotron.model import NemotronH
from tests.nemotron.test_model_vs_transformers import mean_kl, reference
from tools import repack
from tools.logits import logits_and_greedy

N_DECODE = 12


def make_store(model_dir: Path, out: Path) -> Path:
    if not (out / "manifest.json").exists():
        assert repack.main(["--model", str(model_dir), "--out", str(out), "--no-progress"]) == 0
    return out


def tenth_of_experts(store_dir) -> int:
    from expert_store.reader import ExpertStore
    st = ExpertStore.open(store_dir)
    n_blocks = len(st.moe_layers) * st.n_experts
    return max(n_blocks // 10, 8) * st.block_stride


@pytest.fixture(scope="module")
def tiny(synth, tmp_path_factory):
    model_dir = synth("tiny", "nvfp4")
    store = make_store(model_dir, tmp_path_factory.mktemp("store") / "tiny")
    return model_dir, store


def prompt(n, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(14, 500, size=n)]


def leftovers(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix.lstrip("/"))]


def test_pipeline_matches_in_memory_engine_and_transformers(tiny, tmp_path):
    model_dir, store = tiny
    ids = prompt(30)
    ref = NemotronH(model_dir)
    r_logits, r_greedy, r_gl = logits_and_greedy(ref, ids, N_DECODE)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        logits, greedy, gl = logits_and_greedy(eng, ids, N_DECODE)
        stats = eng.cache_stats()
        prefix = eng.sup.prefix
    assert stats["evictions"] > 0 and stats["lookup_misses"] > 0, "the cache was not small enough to evict"
    np.testing.assert_array_equal(greedy, r_greedy)
    np.testing.assert_allclose(logits, r_logits, rtol=1e-5, atol=1e-4)  # expert sum order varies
    np.testing.assert_allclose(gl, r_gl, rtol=1e-5, atol=1e-4)
    hf_logits, hf_greedy, _ = reference(model_dir, ids, N_DECODE, tmp_path)
    assert mean_kl(hf_logits, logits) < 1e-3
    np.testing.assert_array_equal(greedy, hf_greedy)
    assert leftovers(prefix) == [], "shared memory left behind"


def test_pipeline_prefill_then_decode_equals_longer_prefill(tiny):
    model_dir, store = tiny
    ids = prompt(26, seed=4)
    with StreamingEngine(store, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        m = eng.model
        full = m.forward(ids, m.new_state())
        st = m.new_state()
        parts = [m.forward(ids[:17], st)] + [m.forward([t], st) for t in ids[17:]]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-4, atol=1e-4)


def test_cancellation_stops_between_tokens(tiny):
    model_dir, store = tiny
    with StreamingEngine(store, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        cancel = threading.Event()
        got = []
        for step in generate(eng, prompt(9), SamplingParams(max_tokens=50), cancel=cancel):
            got.append(step.token)
            if len(got) == 3:
                cancel.set()
        assert len(got) == 3
        # and the engine is still usable afterwards
        again = [s.token for s in generate(eng, prompt(9), SamplingParams(max_tokens=4))]
        assert len(again) == 4


def test_crashed_io_worker_does_not_change_output(tiny):
    model_dir, store = tiny
    ids = prompt(12, seed=5)
    ref = NemotronH(model_dir)
    r_greedy = [s.token for s in generate(ref, ids, SamplingParams(max_tokens=N_DECODE))]
    with StreamingEngine(store, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        out = []
        killed = None
        for step in generate(eng, ids, SamplingParams(max_tokens=N_DECODE)):
            out.append(step.token)
            if len(out) == 3:
                killed = eng.sup.workers[0].pid
                os.kill(killed, signal.SIGKILL)
        deadline = time.time() + 10
        while eng.sup.restarts["workers"] == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert eng.sup.restarts["workers"] >= 1 and eng.sup.workers[0].pid != killed
    assert out == r_greedy


def resident_keys(shm) -> set[int]:
    from cache_shm.shm import READY
    return {int(k) for k, st in zip(shm.slot_key, shm.slot_state) if k >= 0 and st == READY}


def settled(shm, timeout: float = 10.0) -> None:
    """Waits until the prefetcher has taken every message and no read is queued or in flight, so that what is
    resident no longer changes (the last MoE layer's request, a guess prefetch, may still be landing)."""
    from cache_shm.shm import LOADING
    deadline = time.monotonic() + timeout
    while True:
        s = shm.stats()
        if (len(shm.msg_ring) == 0 and s["demand_queue"] == 0 and s["prefetch_queue"] == 0
                and not (shm.slot_state == LOADING).any()):
            return
        assert time.monotonic() < deadline, f"the cache did not settle in {timeout} s: {s}"
        time.sleep(0.005)


@pytest.mark.parametrize("prefill_protects", [True, False])
def test_prefill_does_not_flush_the_decode_working_set(tiny, prefill_protects, monkeypatch):
    """A long prompt's experts go to the eviction end once used; the twin (prefill requests that touch
    like decode does) must flush the working set, or the check has no power."""
    model_dir, store = tiny
    with StreamingEngine(store, cache_bytes=tenth_of_experts(store) * 5, io_workers=2) as eng:
        if not prefill_protects:
            c = eng.sup.client()
            monkeypatch.setattr(c, "request_prefill", lambda j, ex, guess=(), guess_layer=0: c.request(j, ex, guess, guess_layer))
            monkeypatch.setattr(c, "done_prefill", lambda j, ex: None)
        m = eng.model
        st = m.new_state()
        for t in prompt(2, seed=8):               # decode only: build the decode working set
            m.forward([t], st)
        settled(eng.sup.shm)
        before = resident_keys(eng.sup.shm)
        m.forward(prompt(60, seed=9), m.new_state())   # a long prompt touching most experts
        settled(eng.sup.shm)
        kept = len(before & resident_keys(eng.sup.shm)) / len(before)
    print(f"prefill_protects={prefill_protects}: {kept:.0%} of the decode working set kept")
    if prefill_protects:
        assert kept >= 0.9
    else:
        assert kept < 0.9


def test_record_routing_trace(tiny, tmp_path):
    """`--record-routing`: one record per MoE layer per decoded token, with the chosen experts and the guess."""
    from gpu_worker.streaming import read_routing
    from tools import logits as logits_tool
    model_dir, store = tiny
    trace = tmp_path / "routing.msgpack"
    # 4 greedy tokens: the first 3 are fed through the decode path (the last chosen is never fed)
    rc = logits_tool.main(["--model", str(model_dir), "--store", str(store), "--cache-mb", "0.2",
                           "--ids", "20,21,22,23,24", "--decode", "4", "--out", str(tmp_path / "o.npz"),
                           "--record-routing", str(trace)])
    assert rc == 0
    recs = list(read_routing(trace))
    from nemotron.config import NemotronHConfig
    cfg = NemotronHConfig.from_dir(model_dir)
    n_moe = len(cfg.moe_layers)
    assert len(recs) == 3 * n_moe
    assert [r[0] for r in recs] == list(range(n_moe)) * 3
    assert [r[1] for r in recs] == [t for t in range(3) for _ in range(n_moe)]
    for j, tok, experts, guess, hits in recs:
        assert len(experts) == cfg.num_experts_per_tok == len(guess)
        assert set(hits) <= set(experts)


def test_vram_tier_serves_hot_experts_and_keeps_output(tiny):
    """A device budget beyond the dense part becomes a tier of hot experts: same tokens, fewer slab reads."""
    model_dir, store = tiny
    ids = prompt(10, seed=6)
    ref = NemotronH(model_dir)
    r_greedy = [s.token for s in generate(ref, ids, SamplingParams(max_tokens=N_DECODE))]
    dense = ref.dense_nbytes()
    from expert_store.reader import ExpertStore
    stride = ExpertStore.open(store).block_stride
    with StreamingEngine(store, cache_bytes=tenth_of_experts(store), io_workers=2,
                         vram_bytes=dense + 24 * stride, vram_reserve_bytes=0) as eng:
        out = [s.token for s in generate(eng, ids, SamplingParams(max_tokens=N_DECODE))]
        vt = eng.experts.vram
        acct = eng.accounting.per_token()
    assert vt.n_slots == 24
    assert out == r_greedy
    assert vt.admissions > 0 and vt.hits > 0 and acct["vram_hit_rate"] > 0
    assert len(vt.slot_of) <= 24


def test_vram_budget_below_dense_part_is_a_clear_error(tiny):
    model_dir, store = tiny
    before = set(leftovers("/moestream-"))
    with pytest.raises(ValueError, match="--vram-gb .* too small: the dense part takes"):
        StreamingEngine(store, cache_bytes=tenth_of_experts(store), io_workers=2, vram_bytes=1024)
    assert set(leftovers("/moestream-")) <= before, "a failed start left shared memory behind"


def test_vram_tier_never_exceeds_the_experts_and_leaves_the_rest_to_prefill(tiny):
    """A budget far beyond the model (a large card without --vram-gb): the tier holds every expert, no more, and
    what is left of the budget goes to the prefill's activations instead of idle tier slots."""
    model_dir, store = tiny
    from expert_store.reader import ExpertStore
    st = ExpertStore.open(store)
    every = len(st.moe_layers) * st.n_experts
    dense = NemotronH(model_dir).dense_nbytes()
    budget = dense + 10 * every * st.block_stride
    with StreamingEngine(store, cache_bytes=tenth_of_experts(store), io_workers=2,
                         vram_bytes=budget, vram_reserve_bytes=1 << 20) as eng:
        assert eng.experts.vram.n_slots == every
        used = eng.model.dense_nbytes()
        assert eng.prefill_budget_bytes == budget - used - every * st.block_stride
    with StreamingEngine(store, cache_bytes=tenth_of_experts(store), io_workers=2,
                         vram_bytes=dense + 24 * st.block_stride, vram_reserve_bytes=0) as eng:
        assert eng.experts.vram.n_slots == 24 < every      # a tight budget: the tier as before, prefill the reserve
        assert eng.prefill_budget_bytes == 0


def test_the_prefill_share_of_a_budget(tiny):
    """The server's reserve (`prefill_share`): the base and an eighth of what the dense part leaves, at most 512 MiB
    more (vram_tier.prefill_reserve_bytes); the tier gets the rest. Without the share the reserve is as given."""
    from expert_store.reader import ExpertStore
    from gpu_worker.vram_tier import PREFILL_EXTRA_MAX, prefill_reserve_bytes
    assert prefill_reserve_bytes(8 << 30, 7 << 30, 512 << 20) == (512 << 20) + (512 << 20) // 8
    assert prefill_reserve_bytes(10 << 30, 7 << 30, 512 << 20) == (512 << 20) + (5 << 29) // 8
    assert prefill_reserve_bytes(16 << 30, 7 << 30, 512 << 20) == (512 << 20) + PREFILL_EXTRA_MAX
    assert prefill_reserve_bytes(64 << 30, 7 << 30, 512 << 20) == (512 << 20) + PREFILL_EXTRA_MAX
    assert prefill_reserve_bytes(6 << 30, 7 << 30, 512 << 20) == 512 << 20       # nothing left: the base only
    model_dir, store = tiny
    st = ExpertStore.open(store)
    dense = NemotronH(model_dir).dense_nbytes()
    base, budget = 1 << 20, dense + (1 << 20) + 16 * st.block_stride
    with StreamingEngine(store, cache_bytes=tenth_of_experts(store), io_workers=2, vram_bytes=budget,
                         vram_reserve_bytes=base, prefill_share=True) as eng:
        want = prefill_reserve_bytes(budget, eng.model.dense_nbytes(), base)
        assert want > base and eng.experts.vram.n_slots == (budget - eng.model.dense_nbytes() - want) // st.block_stride
        assert eng.prefill_budget_bytes == want
    with StreamingEngine(store, cache_bytes=tenth_of_experts(store), io_workers=2, vram_bytes=budget,
                         vram_reserve_bytes=base) as eng:     # the twin: no share, the tier takes all 16 slots
        assert eng.experts.vram.n_slots == 16 and eng.prefill_budget_bytes == base
