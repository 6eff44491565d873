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
