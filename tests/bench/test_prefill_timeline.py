"""bench.prefill_timeline's interval algebra against a brute-force twin on a 1 µs grid, and its trace reading."""
import random

import pytest

from bench.prefill_timeline import KINDS, device_events, host_calls, host_profile, raw_events, split, timeline, union


def grid_split(copies, kernels, lo, hi):
    """The twin: every µs of [lo, hi) classified by membership (integer endpoints)."""
    out = dict.fromkeys(KINDS, 0)
    for t in range(lo, hi):
        c = any(s <= t < e for s, e in copies)
        k = any(s <= t < e for s, e in kernels)
        out["both" if c and k else "copy" if c else "compute" if k else "neither"] += 1
    return out


def rand_iv(rng, n, span):
    iv = []
    for _ in range(n):
        s = rng.randrange(span)
        iv.append((s, s + rng.randrange(1, 40)))
    return iv


@pytest.mark.parametrize("seed", range(6))
def test_split_equals_the_grid(seed):
    rng = random.Random(seed)
    copies, kernels = rand_iv(rng, 23, 301), rand_iv(rng, 31, 301)
    lo, hi = rng.randrange(0, 50), rng.randrange(250, 347)
    got = split(union(copies), union(kernels), lo, hi)
    want = grid_split(copies, kernels, lo, hi)
    assert {k: round(v, 6) for k, v in got.items()} == want
    assert sum(got.values()) == pytest.approx(hi - lo)


def test_unmerged_intervals_would_be_caught():
    """The must-fail twin: split over intervals left unmerged double-counts their overlap."""
    copies = [(0, 10), (5, 15)]
    assert split(copies, [], 0, 20) != grid_split(copies, [], 0, 20)
    assert split(union(copies), [], 0, 20) == pytest.approx(grid_split(copies, [], 0, 20))


def test_trace_reading_and_stretches():
    tr = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "prompt", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "moe_router_sync", "ts": 120, "dur": 10},
        {"ph": "X", "cat": "user_annotation", "name": "moe_router_sync", "ts": 160, "dur": 5},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "prompt", "ts": 101, "dur": 300},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 110, "dur": 40,
         "args": {"bytes": 4000, "stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 140, "dur": 30, "args": {"stream": 7}},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 150},
    ]}
    ev, marks, prompt = device_events(tr)
    assert prompt == (100.0, 200.0) and marks == [130.0, 165.0] and len(ev) == 2
    r = timeline(ev, marks, *prompt)
    assert [s["name"] for s in r["stretches"]] == ["pre", "MoE 0", "MoE 1 + tail"]
    assert (r["both"], r["copy"], r["compute"], r["neither"]) == (10, 30, 20, 40)
    assert r["h2d_bytes"] == 4000
    pre, m0, m1 = r["stretches"]
    assert (pre["wall"], pre["copy"], pre["neither"]) == (30, 20, 10)
    assert (m0["copy"], m0["both"], m0["compute"]) == (10, 10, 15)
    assert (m1["compute"], m1["neither"]) == (5, 30)


def test_host_calls_sum_inside_the_prompt():
    tr = {"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 110, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 150, "dur": 5},
        {"ph": "X", "cat": "cuda_driver", "name": "cuMemcpyAsync", "ts": 120, "dur": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 90, "dur": 99},    # before the prompt
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 120, "dur": 50},
    ]}
    got = host_calls(tr, 100, 200)
    assert [(d["name"], d["calls"], d["us"], d["longest_us"]) for d in got] == [
        ("cudaStreamSynchronize", 2, 35.0, 30.0), ("cuMemcpyAsync", 1, 2.0, 2.0)]


def test_raw_events_keep_the_prompt_in_order():
    tr = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 150, "dur": 4, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 120, "dur": 9,
         "args": {"stream": 9, "bytes": 64}},
        {"ph": "X", "cat": "user_annotation", "name": "_prefill_batch", "ts": 110, "dur": 3},
        {"ph": "X", "cat": "user_annotation", "name": "prompt", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "late", "ts": 250, "dur": 4, "args": {"stream": 7}},
    ]}
    assert raw_events(tr, 100, 200) == [["h", -1, 10.0, 3.0, 0, "_prefill_batch"],
                                        ["c", 9, 20.0, 9.0, 64, "Memcpy HtoD"], ["k", 7, 50.0, 4.0, 0, "k2"]]


def test_host_profile_names_the_function_that_spends_the_time():
    import time

    def busy():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.02:
            pass

    def light():
        return sum(range(100))

    def both():
        busy()
        light()
    synced = []
    rows, total = host_profile(both, sync=lambda: synced.append(1))
    assert synced == [1] and total >= 20
    mine = {r["function"].split("(")[-1].rstrip(")"): r for r in rows}
    assert mine["both"]["cum_ms"] >= 20 and mine["both"]["cum_ms"] >= mine["busy"]["cum_ms"]
    assert mine["light"]["cum_ms"] < mine["busy"]["cum_ms"]
    assert [r["own_ms"] for r in rows] == sorted((r["own_ms"] for r in rows), reverse=True)


def test_host_profile_names_who_called_a_function():
    def leaf():
        return sum(range(50))

    def first():
        for _ in range(3):
            leaf()

    def second():
        leaf()

    def both():
        first()
        second()
    rows, _ = host_profile(both, top=1, callers_of=["(leaf)"])
    leaf_row = [r for r in rows if r["function"].endswith("(leaf)")]
    assert len(leaf_row) == 1, "a function asked for stays listed beyond the top rows"
    callers = {c["caller"].split("(")[-1].rstrip(")"): c["calls"] for c in leaf_row[0]["callers"]}
    assert callers == {"first": 3, "second": 1}
    assert all("callers" not in r for r in rows if not r["function"].endswith("(leaf)"))   # only those asked for


def test_kernels_by_name_sum_kernels_only_longest_first():
    raw = [["k", 7, 0.0, 10.0, 0, "gemm"], ["c", 9, 1.0, 500.0, 64, "Memcpy HtoD"], ["k", 7, 12.0, 30.0, 0, "scan"],
           ["h", -1, 0.0, 90.0, 0, "_prefill_batch"], ["k", 8, 20.0, 25.0, 0, "gemm"]]
    from bench.prefill_timeline import kernels_by_name
    assert kernels_by_name(raw) == [dict(name="gemm", launches=2, ms=0.035), dict(name="scan", launches=1, ms=0.03)]


def test_bus_gaps_name_what_the_host_did_while_the_bus_idled():
    """bench.prefill_timeline's bus gaps: the stretches with no H2D copy of at least a millisecond, between bursts and
    after the last one, with the kernels' time and the host's ranges in each; a device-to-device copy is not the bus,
    and a short gap is left out."""
    from bench.prefill_timeline import bus_gaps
    raw = [["c", 9, 0.0, 5000.0, 64, "Memcpy HtoD (Pinned -> Device)"],
           ["h", -1, 4000.0, 3000.0, 0, "_prefill_batch"],            # 2 ms of it in the gap
           ["k", 7, 5500.0, 1000.0, 0, "gemm"],
           ["c", 7, 6000.0, 500.0, 64, "Memcpy DtoD (Device -> Device)"],   # not the bus
           ["h", -1, 7000.0, 1000.0, 0, "_copy_ahead"],
           ["c", 9, 8000.0, 3000.0, 64, "Memcpy HtoD (Pinned -> Device)"],
           ["c", 9, 11500.0, 1000.0, 64, "Memcpy HtoD (Pinned -> Device)"],   # a 0.5 ms gap before it: left out
           ["k", 7, 12500.0, 2000.0, 0, "down"]]
    g = bus_gaps(raw)
    assert [(x["start_ms"], x["ms"], x["compute_ms"], x["tail"]) for x in g] == [(5.0, 3.0, 1.0, False),
                                                                                 (12.5, 2.0, 2.0, True)]
    assert g[0]["host_ms"] == {"_prefill_batch": 2.0, "_copy_ahead": 1.0} and g[1]["host_ms"] == {}
    # the twin: the device-to-device copy counted as the bus splits the 3 ms gap the reading rests on into 1 + 1.5 ms
    twin = [r if r[5] != "Memcpy DtoD (Device -> Device)" else r[:5] + ["Memcpy HtoD twin"] for r in raw]
    assert [x["ms"] for x in bus_gaps(twin)] == [1.0, 1.5, 2.0]
    assert bus_gaps([["k", 7, 0.0, 10.0, 0, "gemm"]]) == []
