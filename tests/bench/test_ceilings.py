"""The floors' rule (a ratio below 0.97 is a wrong floor, never a result), the pipeline's own disk ceiling
and the projection's arithmetic."""
import os
from pathlib import Path

import pytest

from bench.ceilings import (FloorError, checked_ratio, layer_serial_disk, layer_serial_ms, pipeline_disk_gbps,
                            ratio_or_note)
from bench.projection import RTX5060, project


def test_a_ratio_below_its_floor_is_refused():
    assert checked_ratio(1.10, 1.0, "disk") == pytest.approx(1.10)
    assert checked_ratio(0.98, 1.0, "disk") == pytest.approx(0.98)
    with pytest.raises(FloorError, match="the floor is wrong"):       # the must-fail twin: 0.80, as run 8 printed
        checked_ratio(0.80, 1.0, "disk")
    r, why = ratio_or_note(0.8, 1.0, "prefill")
    assert r is None and "prefill" in why


def test_pipeline_disk_ceiling_reads_each_block_once(synth, tmp_path):
    from expert_store.reader import ExpertStore
    from expert_store.writer import repack
    store_dir = tmp_path / "store"
    repack(synth("tiny", "nvfp4"), store_dir, progress=False)
    store = ExpertStore.open(store_dir)
    before = {p.name for p in Path("/dev/shm").glob(f"*moestream-{os.getpid()}-*")}
    r = pipeline_disk_gbps(store, io_workers=2, blocks_per_set=12, repeats=2)
    # each repeat's cache is unlinked when it stops (a second start() inside `with` once leaked one per repeat)
    assert {p.name for p in Path("/dev/shm").glob(f"*moestream-{os.getpid()}-*")} == before
    assert r["blocks_per_set"] == 12 and len(r["runs_gbps"]) == 2 and len(r["reread_gbps"]) == 1
    assert r["gbps"] == max(r["runs_gbps"] + r["reread_gbps"]) > 0


def test_layer_serial_disk_reads_batches_of_each_depth(synth, tmp_path):
    from expert_store.reader import ExpertStore
    from expert_store.writer import repack
    store_dir = tmp_path / "store"
    repack(synth("tiny", "nvfp4"), store_dir, progress=False)
    store = ExpertStore.open(store_dir)
    before = {p.name for p in Path("/dev/shm").glob(f"*moestream-{os.getpid()}-*")}
    r = layer_serial_disk(store, io_workers=2, depths=(1, 3, 10_000), batches=3)
    assert {p.name for p in Path("/dev/shm").glob(f"*moestream-{os.getpid()}-*")} == before
    assert set(r["curve"]) == {"1", "3"} and r["batches"] == 3     # a depth beyond the layer's experts is dropped
    for k, v in r["curve"].items():
        # every block of a batch was read (the bytes over the batches' time: k aligned blocks each)
        assert v["gbps"] * 1e9 * 3 * v["mean_ms"] / 1e3 == pytest.approx(3 * int(k) * store.block_stride, rel=0.02)


def test_layer_serial_ms_prices_each_layers_misses_as_one_batch():
    curve = {"1": dict(mean_ms=2.0), "2": dict(mean_ms=3.0), "4": dict(mean_ms=5.0)}
    # p = 1: every one of 4 choices missed, a batch of 4 a layer: 5 ms x 3 layers
    assert layer_serial_ms(curve, 4.0, 4, 3) == pytest.approx(15.0)
    # p = 0.5 over 2 choices: 1/4 none (0 ms), 1/2 one (2 ms), 1/4 two (3 ms) -> 1.75 a layer
    assert layer_serial_ms(curve, 1.0, 2, 2) == pytest.approx(3.5)
    # a depth between two measured ones is interpolated (3: 4 ms), past the deepest scaled (8: 10 ms)
    assert layer_serial_ms(curve, 3.0, 3, 1) == pytest.approx(4.0)
    assert layer_serial_ms({"4": dict(mean_ms=5.0)}, 8.0, 8, 1) == pytest.approx(10.0)
    # twin: the mean batch at the mean depth (2 ms a layer) is not the mean of the batches (1.75): 0 misses cost nothing
    assert layer_serial_ms(curve, 1.0, 2, 2) != pytest.approx(2 * 2.0)
    with pytest.raises(ValueError, match="empty curve"):
        layer_serial_ms({}, 1.0, 2, 2)


def test_projection_scales_memory_and_instruction_bound_parts():
    m = dict(dense_ms=2.0, dense_bytes=0.9e9, dense_hbm_fraction=0.17, pcie_bytes=0.46e9, pcie_fraction=0.8,
             disk_bytes=0.07e9, disk_fraction=0.9, host_ms=0.3)
    p = project(m, layers_scale=5.0)
    # instruction-bound dense part: x (132 * 1.98) / (30 * 2.5) per layer, x5 layers
    assert p["ms"]["dense"] == pytest.approx(2.0 * 132 * 1.98 / (30 * 2.5) * 5)
    assert p["ms"]["bus"] == pytest.approx(0.46e9 * 5 / (26e9 * 0.8) * 1e3)
    assert p["ms"]["disk"] == pytest.approx(0.07e9 * 5 / (6e9 * 0.9) * 1e3)
    assert p["tps_serial"] < p["tps_overlapped"]
    m["dense_hbm_fraction"] = 0.8                    # memory-bound: bytes at the target's bandwidth instead
    q = project(m, layers_scale=5.0)
    assert q["ms"]["dense"] == pytest.approx(0.9e9 / (RTX5060.hbm_gbps * 1e9 * 0.8) * 1e3 * 5)
