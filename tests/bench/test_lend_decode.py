"""bench.lend_decode on the CPU (the tiny engine, a VRAM tier of 48 slots): the two arms alternate by round, the lend
arm borrows and the other does not, each arm's decode is timed in its windows, and the tokens decoded after the
prompt are the same with and without the lend (the tier refilling changes where blocks are read, not the result)."""
from __future__ import annotations

import pytest
import torch

from bench import lend_decode
from expert_store.reader import ExpertStore
from gpu_worker.engine import StreamingEngine
from nemotron.model import NemotronH
from tests.gpu_worker.test_prefill import prompt
from tests.gpu_worker.test_streaming_pipeline import make_store


@pytest.fixture(scope="module")
def tiny(synth, tmp_path_factory):
    model_dir = synth("tiny", "nvfp4")
    return model_dir, make_store(model_dir, tmp_path_factory.mktemp("lend-store") / "tiny")


def test_the_lend_arms_alternate_and_decode_the_same_tokens(tiny, monkeypatch):
    monkeypatch.setenv("MOESTREAM_PREFILL_LEND_MIN_TOKENS", "0")
    model_dir, store = tiny
    st = ExpertStore.open(store)
    dense = NemotronH(model_dir).dense_nbytes()
    every = len(st.moe_layers) * st.n_experts * st.block_stride + (1 << 20)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=every, io_workers=1,
                         vram_bytes=dense + 48 * st.block_stride, vram_reserve_bytes=0) as eng:
        eng.experts.copy_ahead, eng.experts.ahead_min_tokens = True, 0
        rows = lend_decode.rounds(eng, lambda k: prompt(300, seed=300 + k), prompt(12, seed=7), 1 << 20, 20, 2,
                                  "cpu", settle_tokens=8)
        assert eng.experts.vram.lent == 0
    assert [r["arm"] for r in rows] == ["on", "off", "off", "on"]
    assert all(r["ahead_lent"] > 0 for r in rows if r["arm"] == "on") and all(r["ahead_lent"] == 0 for r in rows
                                                                            if r["arm"] == "off")
    assert [w["tokens"] for w in rows[0]["windows"]] == [(1, 8), (9, 16), (17, 20)]
    for k in range(2):
        on, off = [[t for w in r["windows"] for t in w["chosen"]] for r in rows if r["round"] == k]
        assert len(on) == 20 and on == off
    s = lend_decode.summary(rows)
    assert s["arms"] == ["on", "off"] and s["decode_extra_ms"]["off"] == 0 == s["prefill_saved_ms"]["off"]
    assert len(s["windows"]) == 3 and all(w["ms"]["on"] > 0 and w["ms"]["off"] > 0 for w in s["windows"])
    assert torch.isfinite(torch.tensor(s["decode_extra_ms"]["on"]))
    # the lend arm's refill: the tier took in blocks after the prompt, the other arm's tier had nothing to take back
    assert sum(w["admitted"] for w in rows[0]["windows"]) > 0


def test_arms_parse_and_refuse_nonsense():
    arms = lend_decode.parse_arms("on:MOESTREAM_PREFILL_LEND=1;stream:MOESTREAM_PREFILL_LEND=1,"
                                  "MOESTREAM_VRAM_COPY_STREAM=1;plain")
    assert arms == (("on", {"MOESTREAM_PREFILL_LEND": "1"}),
                    ("stream", {"MOESTREAM_PREFILL_LEND": "1", "MOESTREAM_VRAM_COPY_STREAM": "1"}), ("plain", {}))
    for bad in ("on:X=1;on:X=0", "a:X", "", ":X=1"):
        with pytest.raises(ValueError):
            lend_decode.parse_arms(bad)


def test_an_arms_environment_is_set_for_its_turn_only(monkeypatch):
    monkeypatch.setenv("MOESTREAM_X", "outer")
    monkeypatch.delenv("MOESTREAM_Y", raising=False)
    import os
    from bench.envs import scoped_env
    with scoped_env({"MOESTREAM_X": "1", "MOESTREAM_Y": "2"}):
        seen = (os.environ["MOESTREAM_X"], os.environ["MOESTREAM_Y"])
    assert seen == ("1", "2") and os.environ["MOESTREAM_X"] == "outer" and "MOESTREAM_Y" not in os.environ
