"""`launch_limits` with the scratch charged per chunk (MOESTREAM_LAUNCH_CHUNK): a launch's buffers stay within its
bytes, a small budget's launch takes more experts than with the scratch charged per expert, and the switch names a
bad value. The chunked decode itself (CHUNK experts at a time) equals the whole launch's on the kernels' tests
(tests/kernels/test_expert_prefill_dequant.py); here a twin that charges no scratch overruns the bytes."""
from __future__ import annotations

import pytest

from gpu_worker import prefill_knobs

SUPER = dict(block_stride=3096576, L=1024, I=2688)     # an NVFP4 Super expert's block (16-neuron down groups)


def used(experts, rows, chunk, block_stride, L, I, act=2):
    """The device bytes of one launch as the streaming source allocates them."""
    scratch = min(chunk or experts, experts) * 4 * L * I
    return experts * 2 * block_stride + scratch + rows * (2 * I + act * L + 20)


@pytest.mark.parametrize("launch_mb", [64, 128, 187, 256, 1024])
@pytest.mark.parametrize("chunk", [0, 2, 4])
def test_buffers_within_the_launch_bytes(launch_mb, chunk):
    b = launch_mb << 20
    experts, rows = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, chunk)
    assert 1 <= experts <= prefill_knobs.PREFILL_LAUNCH_EXPERTS and rows >= 64
    if rows > 64:                                   # (a launch gets at least a tile of rows whatever its bytes)
        assert used(experts, rows, chunk, **SUPER) <= b


def test_a_small_budget_takes_more_experts_a_launch():
    """Super at the server's 512 MiB (a launch of 128 MiB + half the slack, ~187 MiB at 16k): 5 experts a launch
    with the scratch per expert, 12 with chunks of 4."""
    b = 187 << 20
    per_expert, _ = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b)
    chunked, rows = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, 4)
    assert (per_expert, chunked) == (5, 12)
    assert rows >= 12 * 16000 * 22 // 512            # a 16k prompt's rows for 12 experts fit one launch


def test_a_twin_without_the_scratch_overruns():
    """Must-fail twin: charging the chunk's scratch nothing would give more experts than the bytes hold."""
    b = 187 << 20

    def free_scratch(block_stride, L, I, act, launch, chunk):
        experts = max(1, min(prefill_knobs.PREFILL_LAUNCH_EXPERTS, launch // 2 // (2 * block_stride)))
        return experts, max(64, (launch - experts * 2 * block_stride) // (2 * I + act * L + 20))
    experts, rows = free_scratch(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, 4)
    assert used(experts, rows, 4, **SUPER) > b


def test_the_switch(monkeypatch):
    monkeypatch.delenv("MOESTREAM_LAUNCH_CHUNK", raising=False)
    assert prefill_knobs.launch_chunk() == 0
    monkeypatch.setenv("MOESTREAM_LAUNCH_CHUNK", "4")
    assert prefill_knobs.launch_chunk() == 4
    for bad in ("four", "-1"):
        monkeypatch.setenv("MOESTREAM_LAUNCH_CHUNK", bad)
        with pytest.raises(ValueError, match="MOESTREAM_LAUNCH_CHUNK"):
            prefill_knobs.launch_chunk()


def test_auto_chunks_keep_the_gemm_size_and_halve_the_launches(monkeypatch):
    """"auto": chunks of the experts the per-expert charge gives (5 at ~187 MiB on Super), launches of about twice (11)
    as many (the freed scratch goes to ring slots), buffers still within the bytes."""
    b = 187 << 20
    args = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b)
    n0, _ = prefill_knobs.launch_limits(*args)
    experts, rows = prefill_knobs.launch_limits(*args, -1)
    assert experts == prefill_knobs.launch_limits(*args, n0)[0] == 11 and 1.7 * n0 <= experts <= 2.5 * n0
    assert used(experts, rows, n0, **SUPER) <= b
    monkeypatch.setenv("MOESTREAM_LAUNCH_CHUNK", "auto")
    assert prefill_knobs.launch_chunk() == -1


def test_batch_knob_with_64_experts_a_launch(monkeypatch):
    """MOESTREAM_PREFILL_BATCH_MB=2304 with MOESTREAM_PREFILL_LAUNCH_EXPERTS=64 (the measuring knobs for fewer, larger
    launches) takes 64 Super experts a launch within its bytes, where the default's 1 GiB takes 31 (the twin);
    nonsense names the variable."""
    monkeypatch.setenv("MOESTREAM_PREFILL_LAUNCH_EXPERTS", "64")
    monkeypatch.delenv("MOESTREAM_PREFILL_BATCH_MB", raising=False)
    assert prefill_knobs.prefill_batch_bytes() == prefill_knobs.PREFILL_BATCH_BYTES == 1 << 30
    small, _ = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2,
                                       prefill_knobs.prefill_batch_bytes())
    monkeypatch.setenv("MOESTREAM_PREFILL_BATCH_MB", "2304")
    b = prefill_knobs.prefill_batch_bytes()
    experts, rows = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b)
    assert b == 2304 << 20 and experts == 64 > small == 31 and used(experts, rows, 0, **SUPER) <= b
    for bad in ("lots", "0"):
        monkeypatch.setenv("MOESTREAM_PREFILL_BATCH_MB", bad)
        with pytest.raises(ValueError, match="MOESTREAM_PREFILL_BATCH_MB"):
            prefill_knobs.prefill_batch_bytes()
