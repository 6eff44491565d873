"""bench.plot_prefill: the curves are the run's rows, a row that beat its floor is never drawn."""
import pytest

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
    from bench.prefill import path_env
    assert path_parts("staged|MOESTREAM_MAMBA_SSD=1#2") == ("staged", "", "", False)
    assert path_parts("staged@1024~512|A=1|B=x") == ("staged", "1024", "", False)
    assert ahead_gate("staged~512|A=1#2") == 512 and ahead_gate("staged|A=1") is None
    assert path_env("staged|MOESTREAM_MAMBA_SSD=1#2") == {"MOESTREAM_MAMBA_SSD": "1"}
    assert path_env("staged~0|A=1|B=#3") == {"A": "1", "B": ""} and path_env("staged#2") == {}
    with pytest.raises(ValueError, match="KEY=VAL"):
        path_env("staged|MOESTREAM_MAMBA_SSD")
    assert ahead_gate("staged~0#2") == 0 and ahead_gate("staged@1024!~512") == 512
    assert ahead_gate("staged") is None and ahead_gate("staged#3") is None
