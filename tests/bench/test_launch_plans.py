"""bench.launch_plans: the engine's own plans of a budgeted layer, counted on the CPU."""
from __future__ import annotations

import math

import pytest

from bench import launch_plans


def test_the_plans_cover_every_expert_and_the_switches_cut_the_launches():
    """Under the server's 512 MiB at 4k and 16k tokens (a router of concentration 0.2, two layers), each plan
    launches every routed expert once (`plan_counts` asserts it), at least as many launches as its experts a launch
    allow, and the long rega launches with the bytes shared by rows launch fewer than the defaults at both sizes
    (the must-fail twin: the defaults' plan, which launches more)."""
    both = "MOESTREAM_PREFILL_REGA_LONG=auto+MOESTREAM_PREFILL_REGA_BY_ROWS=1"
    got = launch_plans.rows(512, [4000, 16000], [0.2], ["none", both], layers=2)
    assert len(got) == 4
    by = {(r["tokens"], r["arm"]): r for r in got}
    for r in got:
        assert 0 < r["ahead_experts"] < r["distinct"] <= 512 and r["launch_bytes"] > 0
        charged = r["distinct"] - r["ahead_experts"]
        assert r["launches"] >= math.ceil(charged / r["experts"]) - 1, r
    for t in (4000, 16000):
        assert by[(t, both)]["launches"] < by[(t, "none")]["launches"], (by[(t, both)], by[(t, "none")])
        assert by[(t, both)]["rega_limit"] > 512
    assert by[(16000, "none")]["rega_limit"] == 0          # dequantized: every expert above a rega launch's rows


def test_an_arm_names_its_settings():
    """bench.envs.arm_env: none, pairs joined by "+", and a clear error for a part that is not KEY=VAL."""
    from bench.envs import arm_env
    assert arm_env("none", "x") == {} and arm_env("A=1+B=auto", "x") == {"A": "1", "B": "auto"}
    with pytest.raises(ValueError, match="--arms entry"):
        arm_env("A=1+B", "--arms entry")
