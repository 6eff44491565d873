"""bench/mamba_prefill.py on the small shape (CPU): every stage is timed, the batched scan agrees with the loop and
launches far fewer kernels per piece, the JSON is written."""
import json

from bench import mamba_prefill


def test_small_shape_runs_every_stage(tmp_path):
    out = tmp_path / "mp.json"
    res = mamba_prefill.main(["--shape", "small", "--sizes", "70,530", "--pieces", "1024", "--reps", "1",
                              "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == res["rows"]
    n = res["launches_per_piece"]
    # 512-token pieces of 32-token chunks: 16 chunks, the loop ~27 launches each, the batched scan ~20 + 16
    assert n["scan_new"] * 5 < n["scan_loop"] and n["mixer_new"] < n["mixer_loop"] and n["conv_loop"] > 5
    assert res["agreement"]["y_rel_err"] < 1e-5 and res["agreement"]["state_rel_err"] < 1e-5
    for r in res["rows"]:
        for k in ("mixer_new_ms", "mixer_loop_ms", "mixer_new_piece1024_ms", "gemms_ms", "scan_new_ms", "scan_loop_ms",
                  "conv_loop_ms"):
            assert r[k] > 0, k
    assert "| 530 |" in mamba_prefill.table(res)
