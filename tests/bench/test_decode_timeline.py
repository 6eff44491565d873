"""bench.decode_timeline's split of a token: the bus's readers (expert kernels, host-to-device copies) against the
dense kernels."""
import pytest

from bench.decode_timeline import is_expert, mean_split, token_split


def k(name, ts, dur):
    return dict(kind="kernel", name=name, ts=ts, dur=dur)


def c(ts, dur, h2d=True, nbytes=0):
    return dict(kind="copy", name="Memcpy HtoD" if h2d else "Memcpy DtoD", ts=ts, dur=dur, h2d=h2d, bytes=nbytes)


def test_a_token_cut_by_what_ran():
    ev = [k("gemv_dense", 0, 30), c(10, 30), k("_expert_layer_kernel_0d1d", 50, 40), k("rms_norm", 95, 3),
          c(60, 10), c(0, 100, h2d=False)]          # a device-to-device copy is not the bus
    s = token_split(ev, 0, 100)
    assert s["wall"] == 100
    assert s["both"] == pytest.approx(20)            # the staging copy under the dense GEMV (10-30)
    assert s["bus"] == pytest.approx(10 + 40)        # 30-40 the copy alone, 50-90 the experts (the copy inside)
    assert s["dense"] == pytest.approx(10 + 3)       # 0-10, 95-98
    assert s["neither"] == pytest.approx(10 + 5 + 2)   # 40-50, 90-95, 98-100
    assert s["expert_kernels"] == 40 and s["copies"] == 40 and s["copies_beside_experts"] == 10
    assert s["bus_idle"] == pytest.approx(100 - 70)
    assert sum(s[x] for x in ("both", "bus", "dense", "neither")) == pytest.approx(s["wall"])


def test_only_the_window_counts_and_the_twin_kernel_is_dense():
    ev = [k("_expert_layer_kernel", 90, 40), k("_expert_layer", 0, 50)]     # a name short of the kernel's: dense
    s = token_split(ev, 0, 100)
    assert s["expert_kernels"] == 10 and s["dense"] == 50
    assert not is_expert("_expert_layer") and is_expert("_sparse_down_sub_kernel")


def test_mean_of_tokens():
    rows = [token_split([k("_vram_up_kernel", 0, 10)], 0, 20), token_split([k("_vram_up_kernel", 0, 30)], 0, 40)]
    assert mean_split(rows)["expert_kernels"] == 20 and mean_split([]) == {}


def test_a_token_cut_at_its_expert_kernels():
    from bench.decode_timeline import layer_stretches
    ev = [k("gemv", 0, 20), c(5, 10), k("_expert_layer_kernel", 30, 20), c(45, 10),
          k("rms_norm", 55, 5), k("_expert_layer_kernel", 70, 20), k("lm_head_gemm", 92, 6)]
    st = layer_stretches(ev, 0, 100)
    assert len(st) == 3                                       # two MoE layers and the tail
    assert st[0]["before"] == 30 and st[0]["before_bus_idle"] == 20 and st[0]["before_copies"] == 10
    assert st[0]["kernel"] == 20 and st[0]["kernel_copies"] == 5          # the copy 45-55 overlaps it 45-50
    assert st[1]["before"] == 20 and st[1]["before_copies"] == 5 and st[1]["before_bus_idle"] == 15
    assert st[2]["before"] == 10 and st[2]["kernel"] == 0 and st[2]["before_bus_idle"] == 10
    assert sum(x["before"] + x["kernel"] for x in st) == pytest.approx(100)


def test_the_stretches_copy_bytes_and_first_copy():
    """Each stretch's and kernel's host-to-device bytes (a copy straddling the kernel's start split by its share of
    time) and how long after the stretch's start its first staging copy began; a device-to-device copy and an 8-byte
    flag copy are not the staging (twin: the same events with the big copy made device-to-device)."""
    from bench.decode_timeline import layer_stretches, raw_token
    ev = [k("gemv", 0, 20), c(4, 2, nbytes=8), c(12, 24, nbytes=2_400_000), k("_expert_layer_kernel", 30, 20),
          c(40, 10, h2d=False, nbytes=1 << 20), k("_expert_layer_kernel", 70, 20)]
    st = layer_stretches(ev, 0, 100)
    assert st[0]["before_copy_bytes"] == pytest.approx(8 + 1_800_000)      # 18 of the copy's 24 µs before 30
    assert st[0]["kernel_copy_bytes"] == pytest.approx(600_000)
    assert st[0]["first_copy"] == 12 and st[1]["before_copy_bytes"] == 0 and st[1]["first_copy"] == 20
    twin = [dict(e, h2d=False) if e.get("bytes") == 2_400_000 else e for e in ev]
    tw = layer_stretches(twin, 0, 100)
    assert tw[0]["before_copy_bytes"] == 8 and tw[0]["first_copy"] == 30      # the flag copy is not a first copy
    raw = raw_token(ev, 10, 60)
    assert [r[2] for r in raw] == [2, 20, 30] and raw[0][4] == 2_400_000


def test_the_cut_ignores_kernels_outside_the_token():
    from bench.decode_timeline import layer_stretches
    ev = [k("_expert_layer_kernel", 120, 10), k("_expert_layer_kernel", 40, 10)]
    st = layer_stretches(ev, 0, 100)
    assert len(st) == 2 and st[0]["before"] == 40 and st[1]["before"] == 50


def test_the_sms_staging_kernel_is_a_staging_copy_not_dense():
    """The slab-routed layers' staging kernel moves bus bytes: it counts with the copies, beside a dense kernel as
    `both`; twin: a kernel named short of it stays dense."""
    ev = [k("gemv_dense", 0, 30), k("_stage_ups_kernel_0d1d2d", 10, 40), k("_stage_ups", 60, 10)]
    s = token_split(ev, 0, 100)
    assert s["copies"] == 40 and s["both"] == pytest.approx(20) and s["bus"] == pytest.approx(20)
    assert s["dense"] == pytest.approx(10 + 10)      # 0-10, and the twin's 60-70


def _ann(name, ts, dur):
    return dict(ph="X", cat="user_annotation", name=name, ts=ts, dur=dur)


def test_host_ranges_per_token_and_the_first_route():
    """Two tokens' windows: each range's µs summed inside them, over two; the first route of each token alone; a range
    outside every window, one of another category and one not named in HOST_RANGES are left out (the twin: counted,
    the sums would differ)."""
    from bench.decode_timeline import HOST_RANGES, host_us_per_token
    trace = {"traceEvents": [
        _ann("route", 10, 30), _ann("route", 50, 10), _ann("token_sync", 90, 8), _ann("bind", 2, 4),
        _ann("route", 110, 20), _ann("route", 140, 6), _ann("token_sync", 190, 12),
        _ann("route", 250, 99),                                    # after the last token
        dict(ph="X", cat="cpu_op", name="route", ts=20, dur=50),   # not a user range
        _ann("token", 0, 100), _ann("something_else", 30, 40),
    ]}
    got = host_us_per_token(trace, [(0.0, 100.0), (100.0, 200.0)])
    assert set(HOST_RANGES) <= set(got)
    assert got["route"] == pytest.approx((30 + 10 + 20 + 6) / 2)
    assert got["route_first"] == pytest.approx((30 + 20) / 2)
    assert got["token_sync"] == pytest.approx((8 + 12) / 2) and got["bind"] == pytest.approx(2)
    assert "token" not in got and "something_else" not in got
    assert host_us_per_token(trace, [])["route"] == 0
