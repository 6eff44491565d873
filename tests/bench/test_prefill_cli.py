"""bench.prefill end to end on the CPU (the tiny preset, two MoE layers, the disk regime only, ~12 s): every disk row
has a floor, the disk was probed again after the rows, and with --io-trace each row carries the IO workers' account
of its own prompt (reads that ended inside its window, as many as the blocks it read)."""
import json

from bench import prefill


def test_disk_rows_traced_and_reprobed(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    prefill.main(["--work", str(tmp_path / "w"), "--preset", "tiny", "--moe-layers", "2", "--device", "cpu",
                  "--sizes", "64,300", "--skip", "kernel,sweep,ram", "--io-trace", "--brief", "--out", str(out)])
    res = json.loads(out.read_text())
    rows = res["disk"]["cpu"]
    assert [r["tokens"] for r in rows] == [64, 300]
    assert res["ceilings"]["disk_probe_after"]["gbps"] > 0
    assert res["ceilings"]["disk_gbps"] >= res["ceilings"]["disk_probe"]["gbps"]
    for r in rows:
        assert r["floor_s"] > 0 and r["blocks_read"] > 0
        io = r["io_trace"]
        # the reads the prompt waited for ended inside its window (a read still landing as the window closes may fall
        # either side); a trace of another window would count none
        assert abs(io["reads_ended"] - r["blocks_read"]) <= 2 and io["reads_ended"] > 0
        assert 0 < io["busy_fraction"] <= 1
    assert "io trace over" in capsys.readouterr().out


def test_rows_with_a_vram_tier(tmp_path):
    """--tier-mb: each regime's engine beside a warm VRAM tier. Each row names the routed experts the tier holds, the
    engine read every one of them there, and the floor's bus bytes leave them out, its disk bytes the missing ones
    it holds (a floor with them in is the twin: larger by their share). The budget row of the same prompt has the
    same floor's counts, from the engine's accounting."""
    out = tmp_path / "prefill.json"
    prefill.main(["--work", str(tmp_path / "w"), "--preset", "tiny", "--moe-layers", "2", "--device", "cpu",
                  "--sizes", "300", "--skip", "kernel,sweep", "--tier-mb", "0.3", "--budget-mb", "64",
                  "--budget-sizes", "300", "--brief", "--out", str(out)])
    res = json.loads(out.read_text())
    for name in ("ram", "disk"):
        r = res[name]["cpu"][0]
        assert 0 < r["tier_resident"] < r["distinct_experts"] and r["tier_read"] == r["tier_resident"], name
        assert prefill.bus_bytes(r, 1000) == (r["distinct_experts"] - r["tier_resident"]) * 1000
        assert prefill.bus_bytes(dict(r, tier_resident=0), 1000) == r["distinct_experts"] * 1000
    d = res["disk"]["cpu"][0]
    assert 0 < d["missing_not_in_tier"] < d["missing_at_start"]       # the tier spared the disk some reads
    # each routed expert the tier does not hold read at most once (a block the small cache held at the start may be
    # evicted and read again: the bound is the distinct ones, not the missing ones)
    assert d["blocks_read"] <= d["distinct_experts"] - d["tier_resident"] + d["prefetch_wasted"]
    b, r = res["budget"][0], res["ram"]["cpu"][0]
    assert (b["distinct_experts"], b["tier_resident"], b["expert_uses"]) == (r["distinct_experts"],
                                                                           r["tier_resident"], r["expert_uses"])
    assert b["floor_s"] > 0 and b["ratio"] == b["ttft_s"] / b["floor_s"]
    assert b["floor_parts_s"]["h2d"] == r["floor_parts_s"]["h2d"]      # the tier's experts left out of both
