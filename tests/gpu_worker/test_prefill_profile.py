"""bench.prefill --profile's per-stage timing (gpu_worker/prefill_profile.py): each layer kind's time lands in its own
stage, the routed experts apart from the MoE layers' dense parts; the profile changes no result and leaves the
model as it found it (the default path runs no wrapper and no extra sync)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from gpu_worker.engine import StreamingEngine
from gpu_worker.prefill import prefill
from gpu_worker.prefill_profile import EXPERT_SHARES, STAGES, PrefillProfile
from nemotron.config import ATTENTION, MOE
from tests.gpu_worker.test_streaming_pipeline import make_store, tenth_of_experts

SLEEP_S = 0.25     # large against what a loaded 2-core VM adds to the other stage (0.1 flaked under load)


@pytest.fixture(scope="module")
def engine(synth, tmp_path_factory):
    model_dir = synth("tiny", "nvfp4")
    store = make_store(model_dir, tmp_path_factory.mktemp("profile-store") / "tiny")
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=tenth_of_experts(store), io_workers=2) as eng:
        yield eng


def _ids(n=120):
    return [int(t) for t in np.random.default_rng(5).integers(14, 1000, size=n)]


def test_profile_changes_nothing_and_restores_the_model(engine):
    m, src = engine.model, engine.experts
    mixers, apply = list(m.mixers), src.apply
    plain = prefill(m, _ids(), m.new_state())
    with PrefillProfile(m) as prof:
        timed = prefill(m, _ids(), m.new_state())
    torch.testing.assert_close(timed, plain, rtol=1e-5, atol=1e-5)
    assert m.mixers == mixers and "apply" not in vars(src) and src.apply == apply and src.prefill_profile is None
    r = prof.result()
    assert set(STAGES + EXPERT_SHARES) <= set(r) and r["launches_timed"] > 0
    kinds = set(m.config.layer_types)
    for stage in ("mamba", "attention", "moe_dense", "experts"):
        assert r[stage] > 0, (stage, kinds, r)
    assert 0 < r["experts_kernels"] <= r["experts"] and r["experts_copies"] == 0      # CPU: nothing is staged
    assert sum(r[s] for s in STAGES) == pytest.approx(r["total_ms"])


@pytest.mark.parametrize("slow", [ATTENTION, MOE])
def test_each_kinds_time_lands_in_its_stage(engine, monkeypatch, slow):
    """Every layer of one kind made SLEEP_S slower: that kind's stage grows by as much, no other stage does (the twin
    slows the other kind)."""
    m = engine.model
    with PrefillProfile(m) as base:
        prefill(m, _ids(), m.new_state())
    n = m.config.layer_types.count(slow)

    def slowed(mixer):
        def run(*a):
            time.sleep(SLEEP_S)
            return mixer(*a)
        return run
    state = m.new_state()            # before the patch: the model asks its mixers for their states
    monkeypatch.setattr(m, "mixers", [slowed(mx) if k == slow else mx for k, mx in zip(m.config.layer_types, m.mixers)])
    with PrefillProfile(m) as prof:
        prefill(m, _ids(), state)
    a, b = base.result(), prof.result()
    stage, other = ("attention", "moe_dense") if slow == ATTENTION else ("moe_dense", "attention")
    assert b[stage] >= n * SLEEP_S * 1e3, (a, b)              # the sleeps are in it, whatever else the CPU did
    assert b[other] - a[other] < 0.5 * n * SLEEP_S * 1e3, (a, b)
