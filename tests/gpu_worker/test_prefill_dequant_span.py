"""The span model counts a layer's decoded NVFP4/FP8 weights (kernels.dense_prefill): the plan gives them only what
the heaviest layer leaves, so no span gets shorter for them (Super at the server's 512 MiB), a large budget holds
the largest layer's whole, and each layer's measured cache peak (the tiny model, CPU) stays within the bytes its
term adds. Twins: the largest layer's bytes forced at 512 MiB shorten the span; a term without the held bytes is
below the measured peak."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from gpu_worker.prefill import _with_dequant, dequant_terms, prefill_span, span_bytes, span_plan, span_terms
from kernels import dense_prefill
from kernels.dense_prefill import DEQUANT_MIN_ROWS
from nemotron.config import NemotronHConfig
from nemotron.model import NemotronH
from tools.synth import build_config


def _super(moe_layers=None):
    return NemotronHConfig.from_dict(build_config("super", "nvfp4",
                                                  argparse.Namespace(pattern=None, moe_layers=moe_layers)))


def _longest(cfg, budget, plan):
    from gpu_worker.prefill import _longest_span
    return _longest_span(cfg, torch.bfloat16, budget, plan)


@pytest.mark.parametrize("device", [None, "cuda"])
def test_decoded_weights_take_no_span_at_512_mib(device, monkeypatch):
    """At the server's 512 MiB the largest layer's decoded weights do not fit beside the MoE layer's launches: the
    plan decodes nothing (by measurement, a partial bound did not pay), or with PARTIAL_DEQUANT only the headroom;
    either way the span is what it was without decoded weights. The twin: holding the largest layer's would shorten
    it."""
    cfg, budget = _super(), 512 << 20
    plan = span_plan(cfg, torch.bfloat16, budget, device)
    largest = max(dequant_terms(cfg, 2).values())
    assert plan.pieces.dequant_bytes == 0
    n = prefill_span(cfg, torch.bfloat16, budget, device=device)
    assert n == _longest(cfg, budget, _with_dequant(plan, 0)), "the span is what it was without decoded weights"
    monkeypatch.setattr("gpu_worker.prefill.PARTIAL_DEQUANT", True)
    partial = span_plan(cfg, torch.bfloat16, budget, device)
    d = partial.pieces.dequant_bytes
    assert 32 << 20 < d < largest, f"{d / 2**20:.1f} MiB: some room, not the largest layer's {largest / 2**20:.0f}"
    assert prefill_span(cfg, torch.bfloat16, budget, device=device) == n
    assert span_bytes(cfg, torch.bfloat16, n, plan=partial) <= budget
    assert _longest(cfg, budget, _with_dequant(plan, largest)) < n


def test_the_partial_bound_switch_is_read_per_plan(monkeypatch):
    """MOESTREAM_PREFILL_PARTIAL_DEQUANT=1 gives the 512 MiB plan the headroom as decoded weights, as PARTIAL_DEQUANT
    does (one engine A/Bs it: the plans' cache keys on it); "0" and unset none; a bad value names the variable."""
    cfg, budget = _super(), 512 << 20
    monkeypatch.setenv("MOESTREAM_PREFILL_PARTIAL_DEQUANT", "1")
    on = span_plan(cfg, torch.bfloat16, budget, "cuda").pieces.dequant_bytes
    assert 32 << 20 < on < max(dequant_terms(cfg, 2).values())
    monkeypatch.setenv("MOESTREAM_PREFILL_PARTIAL_DEQUANT", "0")
    assert span_plan(cfg, torch.bfloat16, budget, "cuda").pieces.dequant_bytes == 0
    monkeypatch.delenv("MOESTREAM_PREFILL_PARTIAL_DEQUANT")
    assert span_plan(cfg, torch.bfloat16, budget, "cuda").pieces.dequant_bytes == 0
    monkeypatch.setenv("MOESTREAM_PREFILL_PARTIAL_DEQUANT", "yes")
    with pytest.raises(ValueError, match="MOESTREAM_PREFILL_PARTIAL_DEQUANT"):
        span_plan(cfg, torch.bfloat16, budget, "cuda")


def test_a_budget_that_holds_the_largest_layer_keeps_its_span():
    cfg, budget = _super(), 2 << 30
    plan = span_plan(cfg, torch.bfloat16, budget, "cuda")
    assert plan.pieces.dequant_bytes == max(dequant_terms(cfg, 2).values())
    assert prefill_span(cfg, torch.bfloat16, budget, device="cuda") == _longest(cfg, budget, _with_dequant(plan, 0))


def test_a_large_budget_holds_the_largest_layer():
    cfg = _super(4)
    plan = span_plan(cfg, torch.bfloat16, 60 << 30, "cuda")
    mamba = dequant_terms(cfg, 2)["mamba"]
    assert mamba == 2 * 4096 * (8192 + 10240 + 128 + 8192)        # Super's in_proj + out_proj in bf16: 209 MiB
    assert plan.pieces.dequant_bytes == max(dequant_terms(cfg, 2).values()) == mamba


def test_terms_count_the_held_bytes_from_the_threshold_on():
    cfg = _super(4)
    plan = span_plan(cfg, torch.bfloat16, 60 << 30, "cuda")
    off = _with_dequant(plan, 0)
    on, base = span_terms(cfg, torch.bfloat16, 4000, plan=plan), span_terms(cfg, torch.bfloat16, 4000, plan=off)
    held = dequant_terms(cfg, 2)
    assert on["mamba"] - base["mamba"] == held["mamba"]
    assert on["attention"] - base["attention"] == held["attention"]
    # the MoE term is the larger of its launch side (unchanged: fc1 is never held beside the launches) and its
    # pieces' side, which grew by the four projections
    assert base["moe"] <= on["moe"] <= base["moe"] + held["moe"]
    short = DEQUANT_MIN_ROWS - 1                # a span too short to decode: nothing counted
    assert span_terms(cfg, torch.bfloat16, short, plan=plan) == span_terms(cfg, torch.bfloat16, short, plan=off)


def test_measured_cache_peak_within_each_layers_term(synth, monkeypatch):
    """The tiny model on the CPU with a bound below its largest layer's decoded weights (so weights evict and
    slice): each layer's cache peak <= what span_terms adds for that layer kind. The twin, a span model that leaves
    the decoded weights out, is exceeded by the peak of a Mamba layer with NVFP4 projections (some are bf16)."""
    model = NemotronH(synth("tiny", "nvfp4"))
    cfg, e = model.config, 4
    held = dequant_terms(cfg, e)
    bound = max(held.values()) * 2 // 3
    caches = []

    class Recorded(dense_prefill.DequantCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            caches.append(self)
    monkeypatch.setattr(dense_prefill, "DequantCache", Recorded)
    plan = _with_dequant(span_plan(cfg, torch.float32, 1 << 30), bound)
    ids = [int(t) for t in np.random.default_rng(2).integers(14, 1000, size=600)]
    model.forward(ids, model.new_state(), pieces=plan.pieces)
    T = len(ids)
    on = span_terms(cfg, torch.float32, T, plan=plan)
    off = span_terms(cfg, torch.float32, T, plan=_with_dequant(plan, 0))
    kinds = cfg.layer_types
    assert len(caches) == len(kinds)
    for kind, c in zip(kinds, caches):
        if kind == "moe":    # the pieces' side of the MoE term: what it adds beside the launch side
            added = min(bound, held["moe"])
        else:
            added = on[kind] - off[kind]
        assert c.peak_bytes <= added, f"{kind}: peak {c.peak_bytes} > counted {added}"
    mamba = [c.peak_bytes for kind, c in zip(kinds, caches) if kind == "mamba"]
    assert max(mamba) > 0, "leaving the decoded weights out of the Mamba term would under-count its peak"


@pytest.mark.parametrize("budget_mb, cap", [(64, 1 << 20), (512, 700), (512, 1 << 20), (4096, 16000), (4096, 1)])
def test_longest_span_is_the_largest_that_fits(budget_mb, cap):
    """The span search (and its shortcut where the whole `cap` fits) against the definition: span_bytes(n) fits,
    span_bytes(n + 1) does not, or n is the cap."""
    from gpu_worker.prefill import _longest_span, span_bytes, span_plan
    cfg = _super()
    budget = budget_mb << 20
    plan = span_plan(cfg, torch.bfloat16, budget, "cpu")
    n = _longest_span(cfg, torch.bfloat16, budget, plan, cap=cap)
    assert 1 <= n <= cap
    assert n == 1 or span_bytes(cfg, torch.bfloat16, n, plan=plan) <= budget
    assert n == cap or span_bytes(cfg, torch.bfloat16, n + 1, plan=plan) > budget
