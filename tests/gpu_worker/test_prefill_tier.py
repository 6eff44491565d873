"""A prompt's experts that the VRAM tier holds are read in place by its launches (`prefill_tier`, session 41): the
same logits as the prompt with the tier ignored, the residents neither asked of the cache nor copied, counted as
`tier_read`; must fail: a tier row holding another expert's block changes the logits (the tier is what was read).
On the CPU the tier is a CPU buffer and the launches the torch twin, reading the same rows the GPU's would address."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.prefill import resident
from gpu_worker.engine import StreamingEngine
from gpu_worker.prefill import prefill
from gpu_worker.vram_tier import VramTier
from expert_store.reader import ExpertStore
from tests.gpu_worker.test_prefill import prompt
from tests.gpu_worker.test_streaming_pipeline import make_store, tenth_of_experts
from tests.nemotron.test_model_vs_transformers import mean_kl

HELD = 12            # experts of each MoE layer the tier holds (of the tiny preset's 32)


@pytest.fixture(scope="module")
def tiny(synth, tmp_path_factory):
    model_dir = synth("tiny", "nvfp4")
    return model_dir, make_store(model_dir, tmp_path_factory.mktemp("tier-store") / "tiny")


def _fill(src, store_dir, swap: bool = False, device="cpu") -> VramTier:
    """A tier holding experts 0 .. HELD - 1 of every MoE layer, their blocks read from the store (swap: expert e's
    row holds expert e + 1's block)."""
    st = ExpertStore.open(store_dir)
    n_moe = len(st.moe_layers)
    vt = VramTier(n_moe * HELD, src.slot_bytes, src.block_bytes, device, admit_after=1)
    for j in range(n_moe):
        for e in range(HELD):
            vt.admit(j, e, torch.from_numpy(st.read_block(j, e + 1 if swap else e)).to(device))
    return vt


def _run(eng, ids, monkeypatch, tier_on: bool, asked: list, missing: list | None = None):
    """The prompt's logits and accounting; `missing` gets the routed (layer, expert) pairs the RAM cache lacked at
    its start."""
    monkeypatch.setenv("MOESTREAM_PREFILL_TIER", "1" if tier_on else "0")
    asked.clear()
    m = eng.model
    before = resident(eng)
    out = prefill(m, ids, m.new_state())
    if missing is not None:
        missing[:] = sorted(eng.experts.prefill_acct.routed_keys() - before)
    return out.float().cpu().numpy(), eng.experts.prefill_acct.last


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the grouped launches reading tier addresses: CUDA"))])
def test_tier_residents_are_read_in_place(tiny, monkeypatch, device):
    """CPU: the torch twin reads the tier's rows; CUDA (bf16): the grouped launches read them by address, staged."""
    model_dir, store = tiny
    ids = prompt(300, seed=3)
    kw = dict(device="cuda", dtype=torch.bfloat16) if device == "cuda" else {}
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=2, **kw) as eng:
        src = eng.experts
        asked: list = []
        request = src.client.request_prefill

        def spy(j, experts, *a, **kw):       # what each layer asks of the cache
            asked.append((j, list(experts)))
            return request(j, experts, *a, **kw)
        monkeypatch.setattr(src.client, "request_prefill", spy)
        src.vram = _fill(src, store, device=device)
        ref, pa_off = _run(eng, ids, monkeypatch, False, asked)
        asked_off = list(asked)
        missing: list = []
        got, pa_on = _run(eng, ids, monkeypatch, True, asked, missing)
        asked_on = list(asked)
        src.vram = _fill(src, store, swap=True, device=device)
        bad, _ = _run(eng, ids, monkeypatch, True, asked)
        src.vram = None
    held_routed = sum(1 for _, ex in asked_off for e in ex if e < HELD)
    assert pa_off.tier_read == 0 and held_routed > 0
    assert pa_off.tier_resident == pa_on.tier_resident == held_routed   # what the tier held, read there or not
    assert pa_on.tier_read == held_routed                    # every routed resident read from the tier ...
    assert all(e >= HELD for _, ex in asked_on for e in ex)  # ... and none asked of the cache
    assert pa_on.distinct_experts == pa_off.distinct_experts
    # what must come from the disk: missing from the cache and not held by the tier (the API bench's disk floor);
    # the twin, the count that ignores the tier, is larger
    assert pa_on.missing_at_start == len(missing)
    assert pa_on.missing_not_in_tier == sum(1 for _, e in missing if e >= HELD) < pa_on.missing_at_start
    # the same blocks, launched in another order (residents first): equal up to the fp32 sums' order on the CPU; on
    # CUDA the launches group differently (their kernel paths too), in bf16 through every layer: a KL's worth
    if device == "cpu":
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    else:
        assert mean_kl(ref, got) < 1e-3
    assert int(got.argmax()) == int(ref.argmax())
    assert np.abs(bad - ref).max() > 5 * np.abs(got - ref).max() + 1e-3, "the tier's rows were not what was read"


def test_the_next_layers_residents_are_not_copied_ahead_or_prefetched(tiny, monkeypatch):
    """The copies ahead and the disk prefetch for the next MoE layer skip what the tier holds of it."""
    model_dir, store = tiny
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        src = eng.experts
        src.vram = _fill(src, store)
        g = np.zeros(src.store.n_experts, dtype=np.int64)
        g[[1, 5, HELD, HELD + 3]] = [9, 8, 7, 6]
        monkeypatch.setenv("MOESTREAM_PREFILL_TIER", "1")
        ranked = src._ahead_ranked(1, g, 8, counted=False)
        monkeypatch.setenv("MOESTREAM_PREFILL_TIER", "0")
        ranked_off = src._ahead_ranked(1, g, 8, counted=False)
        src.vram = None
    assert ranked == [HELD, HELD + 3] and ranked_off == [1, 5, HELD, HELD + 3]
