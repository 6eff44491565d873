"""bench.prefill's rounds: a path repeated as PATH#k is one group per regime and prompt size, its median and minimum
set beside the regime's first path at that size."""
from bench.prefill import print_rounds, rounds


def _row(tokens, ms, floor_ms=90.0):
    return dict(tokens=tokens, ttft_s=ms / 1e3, floor_s=floor_ms / 1e3)


def _res():
    return dict(ceilings={}, ram={
        "staged": [_row(16000, 958.8), _row(4000, 98.4)],               # the process's first 16k compiled
        "staged|E=1": [_row(16000, 129.1), _row(4000, 98.1)],
        "staged#2": [_row(16000, 131.1), _row(4000, 97.8)],
        "staged|E=1#2": [_row(16000, 136.1), _row(4000, 95.6)],
        "staged#3": [_row(16000, 133.0), _row(4000, 99.0)],
    }, disk={"staged_no_ahead": [_row(4000, 1594.4, 1430.8)]})


def test_rounds_group_repeats_by_path_and_size(capsys):
    g = {(x["regime"], x["path"], x["tokens"]): x for x in rounds(_res())}
    assert set(g) == {("ram", "staged", 16000), ("ram", "staged", 4000), ("ram", "staged|E=1", 16000),
                      ("ram", "staged|E=1", 4000), ("disk", "staged_no_ahead", 4000)}
    base, ee = g["ram", "staged", 16000], g["ram", "staged|E=1", 16000]
    assert base["n"] == 3 and base["ttft_ms"] == [958.8, 131.1, 133.0]
    assert abs(base["median_ms"] - 133.0) < 1e-9 and abs(base["min_ms"] - 131.1) < 1e-9
    assert base["max_ms"] == 958.8 and abs(base["median_ratio"] - 133.0 / 90.0) < 1e-9
    assert ee["n"] == 2 and ee["vs_first"] == "staged"
    assert abs(ee["median_delta_ms"] - (132.6 - 133.0)) < 1e-9 and abs(ee["min_delta_ms"] - (129.1 - 131.1)) < 1e-9
    assert base["median_delta_ms"] == 0 and g["disk", "staged_no_ahead", 4000]["vs_first"] == "staged_no_ahead"
    print_rounds(rounds(_res()))
    out = capsys.readouterr().out
    assert "rounds: ram staged|E=1 16000 | 2 | 132.6 (1.47) | 129.1 | 136.1 | -0.4 / -2.0 ms against staged" in out


def test_twin_without_the_repeats_stripped_is_caught():
    """Must-fail twin: grouped by the whole path (PATH#k its own group) every group is a single round, and the
    comparison above would be against one round each."""
    res = _res()
    twin = {p.replace("#", "_"): rows for p, rows in res["ram"].items()}     # no "#k" left to strip
    g = rounds(dict(res, ram=twin))
    assert all(x["n"] == 1 for x in g)
    assert not all(x["n"] == 1 for x in rounds(res))


def test_single_rounds_print_nothing(capsys):
    print_rounds(rounds(dict(ceilings={}, ram={"staged": [_row(1000, 80.0)]})))
    assert capsys.readouterr().out == ""


def test_a_round_below_its_floor_prints_no_ratio(capsys):
    """A disk probe that read slower than the pipeline makes a floor the run beats (session 32 call 4: 0.88-0.95):
    the rounds' line says the floor is wrong instead of printing the ratio; a ratio above MIN_RATIO prints as it is.
    The twin (the old print, the bare quotient) would have shown 0.90."""
    from bench.ceilings import MIN_RATIO
    from bench.prefill import shown_ratio
    rows = [_row(4000, 3000.0, 3333.3), _row(4000, 3010.0, 3333.3)]
    print_rounds(rounds(dict(ceilings={}, disk={"staged_no_ahead": rows[:1], "staged_no_ahead#2": rows[1:]})))
    out = capsys.readouterr().out
    assert "floor wrong: 0.90 < 0.97" in out and "(0.90)" not in out
    assert shown_ratio(1.25, 1.0) == "1.25" and shown_ratio(MIN_RATIO, 1.0) == f"{MIN_RATIO:.2f}"


def test_a_faster_disk_probe_after_the_rows_raises_their_floors():
    """The disk probed again after the disk rows: where it reads faster, every row's floor is taken at it (a probe in a
    slow stretch of the host's disk made floors the rows beat); where slower, the first probe stands. The twin (the
    floors left at the first probe) keeps the disk row under MIN_RATIO."""
    import argparse

    from bench.ceilings import MIN_RATIO
    from bench.prefill import reprobe_disk, with_floor
    from nemotron.config import NemotronHConfig
    from tools.synth import build_config
    cfg = NemotronHConfig.from_dict(build_config("super", "nvfp4", argparse.Namespace(pattern=None, moe_layers=8)))
    c = dict(h2d_gbps=55.0, gemm_tflops=770.0, disk_gbps=1.5, disk_probe=dict(gbps=1.5))
    bb = 3096576

    def row(missing, sec):
        return with_floor(dict(tokens=4000, ttft_s=sec, distinct_experts=2985, missing_at_start=missing,
                               expert_uses=4000 * 22), cfg, bb, c)
    res = dict(ram={"staged": [row(0, 0.18)]}, disk={"staged_no_ahead": [row(1000, 1.95)]})
    disk = res["disk"]["staged_no_ahead"][0]
    assert disk["floor_by"] == "disk" and disk["ratio"] < MIN_RATIO       # the twin: left as first probed
    reprobe_disk(res, c, lambda: dict(gbps=1.2), cfg, bb)                 # slower after: nothing moves
    assert c["disk_gbps"] == 1.5 and disk["ratio"] < MIN_RATIO
    reprobe_disk(res, c, lambda: dict(gbps=1.8), cfg, bb)
    assert c["disk_gbps"] == 1.8 and c["disk_probe_after"]["gbps"] == 1.8
    assert abs(disk["floor_s"] - 1000 * bb / 1.8e9) < 1e-9 and disk["ratio"] > MIN_RATIO
    assert res["ram"]["staged"][0]["floor_by"] == "h2d"
