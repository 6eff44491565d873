"""bench.projection --instrument: the policy rows are interpolated in cache fraction (an out-of-range share is an
error), the bus bytes are up + the active share of down (all of the block when every group is active), and
bigger sub-group blocks shrink the box's cache share."""
from __future__ import annotations

import pytest

from bench.projection import RTX5060, instrument_projection, policy_at
from kernels.expert_block import ExpertGeometry


def rows(label="lru", prefetch=True):
    # reads per use = (demand + prefetch) / accesses: 0.8 at 10 %, 0.4 at 50 %
    return [dict(policy=label, prefetch=prefetch, fraction=f, hit_rate=h, demand_reads=d, prefetch_reads=p,
                 accesses=100) for f, h, d, p in ((0.1, 0.5, 60, 20), (0.5, 0.9, 30, 10))]


def test_policy_at_interpolates_and_refuses_outside():
    r = policy_at(rows(), "lru+prefetch", 0.3)
    assert r["hit_rate"] == pytest.approx(0.7) and r["reads_per_use"] == pytest.approx(0.6)
    assert policy_at(rows(), "lru+prefetch", 0.1)["reads_per_use"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="outside"):
        policy_at(rows(), "lru+prefetch", 0.6)
    with pytest.raises(ValueError, match="no policy_sim rows"):
        policy_at(rows(), "lru", 0.3)          # the demand-only label is not in these rows


def run_inputs():
    return dict(moe_layers=4, projection_inputs=dict(
        dense_ms=2.0, dense_bytes=1e9, dense_hbm_fraction=0.3, pcie_bytes=0.0, pcie_fraction=0.86,
        disk_bytes=4e7, disk_fraction=1.0, host_ms=0.3))


def test_bus_bytes_are_the_whole_block_when_every_group_is_read():
    g16 = ExpertGeometry(L=1024, I=2688, fmt="nvfp4")
    full = instrument_projection(run_inputs(), rows(), "lru+prefetch", {"16": 1.0}, 1.0, sizes=(16,))[0]
    assert full["bus_bytes"] == pytest.approx(40 * 22 * g16.block_bytes)
    sparse = instrument_projection(run_inputs(), rows(), "lru+prefetch", {"16": 1.0}, 0.39, sizes=(16,))[0]
    assert sparse["bus_bytes"] < full["bus_bytes"] and sparse["ms"]["bus"] < full["ms"]["bus"]
    assert sparse["disk_bytes"] == full["disk_bytes"]          # the disk reads whole blocks either way


def test_bigger_blocks_shrink_the_cache_share_and_read_more():
    ps = instrument_projection(run_inputs(), rows(), "lru+prefetch", {"16": 1.0, "4": 0.5}, 0.39, sizes=(16, 4))
    p16, p4 = ps
    g4 = ExpertGeometry(L=1024, I=2688, fmt="nvfp4", down_group_neurons=4)
    assert p4["cache_share"] == pytest.approx(RTX5060.cache_gb * 1e9 / (40 * 512 * g4.block_stride))
    assert p4["cache_share"] < p16["cache_share"] and p4["reads_per_use"] > p16["reads_per_use"]
    assert p4["disk_bytes"] > p16["disk_bytes"] and p4["bus_bytes"] < p16["bus_bytes"]
    assert any(a.startswith("N = 4: block") for a in p4["assumptions"])
    assert not any("as in the run's disk regime" in a for a in p4["assumptions"])


def test_down_ratios_read_both_bench_formats():
    from bench.projection import down_ratios
    dg = {"rows": [{"down_group_neurons": 16, "down_vs_16": 1.0}, {"down_group_neurons": 4, "down_vs_16": 0.59}]}
    co = {"orders": [{"order": "random", "down_vs_unordered_16": {"16": 1.19}},
                     {"order": "identity", "down_vs_unordered_16": {"16": 1.0, "4": 0.51}}]}
    assert down_ratios(dg) == {"16": 1.0, "4": 0.59}
    assert down_ratios(co) == {"16": 1.0, "4": 0.51}        # the unordered row, not the first


def test_down_ratios_pick_an_order_of_the_instrument_measurement():
    import pytest
    from bench.projection import down_ratios
    ib = {"bytes": {"nvfp4": {"vs_unordered_16": {"identity": {"16": 1.0, "4": 0.56},
                                                  "coact": {"16": 0.58, "4": 0.42}}}}}
    assert down_ratios(ib) == {"16": 1.0, "4": 0.56}
    assert down_ratios(ib, "coact") == {"16": 0.58, "4": 0.42}
    co = {"orders": [{"order": "identity", "down_vs_unordered_16": {"16": 1.0}},
                     {"order": "coactivation", "down_vs_unordered_16": {"16": 0.74}}]}
    assert down_ratios(co, "coactivation") == {"16": 0.74}
    with pytest.raises(ValueError, match="not in the json"):
        down_ratios(ib, "random")
    with pytest.raises(ValueError, match="no neuron orders"):
        down_ratios({"rows": []}, "coact")
