"""bench.plot_prefill: the curves are the run's rows, a row that beat its floor is never drawn."""
from bench import plot_prefill


def _row(tokens, ttft, floor):
    return dict(tokens=tokens, ttft_s=ttft, floor_s=floor, ratio=ttft / floor)


def test_series_keeps_rows_whose_floor_held_and_plots(tmp_path):
    res = dict(preset="super", moe_layers=4, device="cpu",
               ram=dict(a=[_row(1000, 0.11, 0.075), _row(128, 0.07, 0.056)],
                        b=[_row(128, 0.05, 0.056), _row(1000, 0.12, 0.075)]))     # b at 128 beat its floor
    curves, floors = plot_prefill.series(res)
    assert curves["a"] == [(128, 70.0, 0.07 / 0.056), (1000, 110.0, 0.11 / 0.075)]
    assert [p[0] for p in curves["b"]] == [1000]            # the twin: the 0.89x row is left out
    assert floors == {128: 56.0, 1000: 75.0}
    out = plot_prefill.plot(res, tmp_path / "p.png")
    assert out.stat().st_size > 1000


def test_prefill_path_parts():
    """bench.prefill's --paths entries: base, largest piece, glue, copies ahead in runs; '#k' only repeats."""
    from bench.prefill import path_parts
    assert path_parts("staged_no_ahead") == ("staged_no_ahead", "", "", False)
    assert path_parts("staged_no_ahead@512-#2") == ("staged_no_ahead", "512", "-", False)
    assert path_parts("staged@4096+!") == ("staged", "4096", "+", True)
    assert path_parts("staged!") == ("staged", "", "", True)
    assert path_parts("zero_copy+#3") == ("zero_copy", "", "+", False)
    from bench.prefill import ahead_gate
    assert path_parts("staged~0#2") == ("staged", "", "", False)
    assert path_parts("staged@1024!~512") == ("staged", "1024", "", True)
    assert ahead_gate("staged~0#2") == 0 and ahead_gate("staged@1024!~512") == 512
    assert ahead_gate("staged") is None and ahead_gate("staged#3") is None
    # "%": the slab's blocks copied by torch (bench.prefill.slab_copies sets the engine's switch for that path only)
    import os
    from bench.prefill import slab_copies
    assert path_parts("staged%#2") == ("staged", "", "", False) and path_parts("staged@512-%") == ("staged", "512", "-", False)
    try:
        slab_copies("staged%#2")
        assert os.environ["MOESTREAM_SLAB_COPIES"] == "torch"
        slab_copies("staged#2%")              # after the repeat mark: a name, not a switch
        assert "MOESTREAM_SLAB_COPIES" not in os.environ
        assert path_parts("staged&#2") == ("staged", "", "", False)
        slab_copies("staged&")
        assert os.environ["MOESTREAM_STAGE_STREAMS"] == "1" and "MOESTREAM_SLAB_COPIES" not in os.environ
        slab_copies("staged")
        assert "MOESTREAM_STAGE_STREAMS" not in os.environ
    finally:
        os.environ.pop("MOESTREAM_SLAB_COPIES", None)
        os.environ.pop("MOESTREAM_STAGE_STREAMS", None)
