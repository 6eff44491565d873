"""bench.e2e_stream's sub-group table options: a size the store cannot hold and a checkpoint written with other
synth knobs are refused with a clear error before anything runs (the full table runs in bench/gpu_session.sh
`subgroups`; its CPU smoke takes ~30 s and is not a CI test)."""
from __future__ import annotations

import json

import pytest

from bench import e2e_stream


def test_a_sub_group_size_the_store_cannot_hold_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        e2e_stream.main(["--work", str(tmp_path), "--device", "cpu", "--down-group-neurons", "16,3"])
    assert "each size must be one of" in capsys.readouterr().err


def test_a_checkpoint_written_with_other_synth_knobs_is_not_reused(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "synth_args.json").write_text(json.dumps("--sparsity 0.92"))
    with pytest.raises(SystemExit, match="written with synth args '--sparsity 0.92'"):
        e2e_stream.main(["--work", str(tmp_path), "--device", "cpu", "--down-group-neurons", "16",
                         "--synth-args", "--sparsity 0.95"])
    # twin: the same knobs pass the check and go on (to the repack of this empty checkpoint, which fails)
    with pytest.raises(RuntimeError, match="tools.repack"):
        e2e_stream.main(["--work", str(tmp_path), "--device", "cpu", "--down-group-neurons", "16",
                         "--synth-args", "--sparsity 0.92"])


def test_down_bytes_leave_out_the_up_halves_and_the_wrong_guesses_staged():
    """The bus carries the used experts' ups, the down groups read, and the staged ups of guesses the router did not
    choose; the sub-group table's down bytes are the second alone. Twin: without the wrong guesses' ups taken out
    (the first GPU table's N = 16 row), the down bytes come out high by exactly those."""
    uses, up_b, down, wasted = 44, 1_548_288, 23_250_000.0, 32_126_976.0
    g = dict(pcie_bytes_per_token=uses * up_b + down + wasted, pcie_wasted_bytes_per_token=wasted)
    assert e2e_stream.down_bytes_per_token(g, uses, up_b) == down
    assert e2e_stream.down_bytes_per_token(dict(pcie_bytes_per_token=uses * up_b + down), uses, up_b) == down
    assert g["pcie_bytes_per_token"] - uses * up_b == down + wasted != down
