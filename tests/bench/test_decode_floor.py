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


def test_down_groups_at_the_group_readers_rate():
    """With the group probe, the down groups (read by the SMs in 9 KiB pieces) at its rate, the other SM bytes at the
    whole-row rate, the copied ones at the copies'; the down share never beyond what the SMs read."""
    c = dict(zero_copy=50.0, up_copy=52.0, zero_copy_groups=46.0)
    f = ram_decode_floor_ms(moved=460e6, copied=100e6, ceilings=c, h2d_gbps=55.0, down=190e6)
    assert f["readers"] == pytest.approx((100e6 / 52.0 + 360e6 / 50.0) / 1e6)
    assert f["readers_chunked"] == pytest.approx((100e6 / 52.0 + 170e6 / 50.0 + 190e6 / 46.0) / 1e6)
    assert f["readers_chunked"] > f["readers"]
    g = ram_decode_floor_ms(moved=460e6, copied=100e6, ceilings=c, h2d_gbps=55.0, down=999e6)
    assert g["readers_chunked"] == pytest.approx((100e6 / 52.0 + 360e6 / 46.0) / 1e6)
    assert "readers_chunked" not in ram_decode_floor_ms(460e6, 100e6, dict(zero_copy=50.0, up_copy=52.0), 55.0,
                                                        down=190e6)


def test_group_addresses_are_the_blocks_down_groups_at_the_share():
    """Each row's groups inside its down section, distinct, in order, `density` of them; a twin with the row stride
    wrong lands outside the rows' down sections."""
    from bench.ceilings import group_addresses
    base, stride, off, gb, ng = 1 << 20, 3_096_576, 1_548_288, 9216, 168
    a = group_addresses(base, stride, 5, off, gb, ng, 0.71, seed=3)
    k = round(0.71 * ng)
    assert a.size == 5 * k
    rows = (a - base) // stride
    assert (rows == [r for r in range(5) for _ in range(k)]).all()
    g = ((a - base) % stride - off)
    assert (g % gb == 0).all() and (g // gb < ng).all() and (g >= 0).all()
    for r in range(5):
        assert (g[rows == r][1:] > g[rows == r][:-1]).all()
    wrong = group_addresses(base, stride + 4096, 5, off, gb, ng, 0.71, seed=3)
    assert not (((wrong - base) % stride - off) % gb == 0).all()
