"""bench.ceilings.disk_needed_bytes: the disk floor counts the bytes the tokens needed, not the guesses wasted."""
import pytest

from bench.ceilings import disk_needed_bytes


def test_wasted_guesses_leave_the_floor():
    # session 21's disk regime: 1,305 demand reads, 923 prefetches of which 295 evicted unused
    read = 2228 * 1.5e6
    n = disk_needed_bytes(read, dict(demand_reads=1305, prefetch_issued=923, prefetch_wasted=295))
    assert n["per_read"] == pytest.approx(1.5e6)
    assert n["wasted"] == pytest.approx(295 * 1.5e6)
    assert n["needed"] == pytest.approx((2228 - 295) * 1.5e6)
    assert n["needed"] + n["wasted"] == pytest.approx(read)


def test_never_below_the_demand_reads():
    """Wasted blocks counted in the window but read before it (the prompt's guesses) cannot take the floor under the
    blocks that had to be read: 60 counted wasted against 20 read ahead in the window leaves the 80 demand reads
    (the twin that subtracts every counted waste would give 40)."""
    c = dict(demand_reads=80, prefetch_issued=20, prefetch_wasted=60)
    n = disk_needed_bytes(100e6, c)
    assert n["needed"] == pytest.approx(80e6)
    twin = 100e6 - c["prefetch_wasted"] * n["per_read"]
    assert twin < c["demand_reads"] * n["per_read"] <= n["needed"]


def test_no_counters_keeps_every_byte():
    assert disk_needed_bytes(5e6, {}) == dict(needed=5e6, wasted=0.0, per_read=0.0)
    assert disk_needed_bytes(0.0, dict(demand_reads=3))["needed"] == 0.0


def test_a_floor_without_the_waste_is_higher_ratio():
    """The ratio against the needed bytes is higher than against every byte read whenever a guess was wasted (the
    old floor flattered the pipeline by its own waste)."""
    read, ms, gbps = 76.2e6, 44.05, 2.13
    n = disk_needed_bytes(read, dict(demand_reads=1305, prefetch_issued=923, prefetch_wasted=295))
    old = ms / (read / (gbps * 1e9) * 1e3)
    new = ms / (n["needed"] / (gbps * 1e9) * 1e3)
    assert new > old * 1.1
