"""bench.ceilings.ram_decode_floor_ms: each byte priced at its reader's ceiling."""
import pytest

from bench.ceilings import FloorError, checked_ratio, ram_decode_floor_ms


def test_each_byte_at_its_readers_rate():
    f = ram_decode_floor_ms(moved=233.4e6, copied=47.1e6, ceilings=dict(zero_copy=50.9, up_copy=52.7),
                            h2d_gbps=55.46, dense_ms=0.4)
    assert f["copy_engine"] == pytest.approx(233.4e6 / 55.46e9 * 1e3)
    assert f["readers"] == pytest.approx((47.1e6 / 52.7 + 186.3e6 / 50.9) / 1e6)
    assert f["readers"] > f["copy_engine"]           # slower readers, a higher floor


def test_copied_never_beyond_moved_and_dense_is_the_least():
    f = ram_decode_floor_ms(moved=10e6, copied=50e6, ceilings=dict(zero_copy=50.0, up_copy=100.0), h2d_gbps=55.0,
                            dense_ms=0.01)
    assert f["readers"] == pytest.approx(10e6 / 100e9 * 1e3)
    f = ram_decode_floor_ms(moved=1e6, copied=0, ceilings=dict(zero_copy=50.0, up_copy=50.0), h2d_gbps=55.0,
                            dense_ms=5.0)
    assert f == dict(copy_engine=5.0, readers=5.0)


def test_without_the_readers_probe_only_the_copy_engine_floor():
    assert set(ram_decode_floor_ms(1e6, 0, {}, 55.0)) == {"copy_engine"}


def test_a_run_faster_than_the_readers_floor_is_refused():
    f = ram_decode_floor_ms(moved=233.4e6, copied=0, ceilings=dict(zero_copy=50.0, up_copy=55.0), h2d_gbps=55.0)
    with pytest.raises(FloorError):      # the twin: a run at 92 % of the floor says the floor is wrong
        checked_ratio(0.92 * f["readers"], f["readers"], "RAM regime")
    assert checked_ratio(1.2 * f["readers"], f["readers"], "RAM regime") == pytest.approx(1.2)
