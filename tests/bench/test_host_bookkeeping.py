"""bench/host_bookkeeping.py on a few tokens: every scenario takes the path it is named for (all hits: every layer
addressed; misses: layers run eagerly; a VRAM tier: hits there), the figures are written."""
import json

from bench import host_bookkeeping


def test_each_scenario_takes_its_path(synth, tmp_path):
    from expert_store.writer import repack
    store = tmp_path / "store"
    repack(synth("tiny", "nvfp4", 0, "--experts", "64", "--top-k", "22", "--n-group", "1", "--topk-group", "1"),
           store, progress=False)
    host_bookkeeping.main(["--store", str(store), "--tokens", "6", "--repeats", "1", "--out-dir", str(tmp_path),
                           "--tag", "t"])
    med = json.loads((tmp_path / "host_bookkeeping-t.json").read_text())["median"]
    hits, misses, vram = med["hits"], med["misses"], med["vram"]
    assert hits["hit_rate"] == 1.0 and hits["addressed_share"] == 1.0 and hits["after_launch"] > 0
    assert misses["hit_rate"] < 1.0 and misses["addressed_share"] < 1.0      # the twin of the all-hits path
    assert vram["vram_hit_rate"] > 0.5
    for m in med.values():
        assert m["critical_path"] > 0 and m["lookup"] > 0 and m["message"] > 0
    assert "| hits |" in (tmp_path / "host_bookkeeping-t.txt").read_text()
