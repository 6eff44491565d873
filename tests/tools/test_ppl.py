"""Perplexity of the trained instrument on held-out text: the engine (in memory and streaming through the store
with a cache of 10 % of the experts) equals transformers' fp32 reference within 1 %; nibble-swapped NVFP4
weights make it more than 10x worse."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, copy_with_swapped_nibbles
from tools.ppl import engine_logits, perplexity, reference_logits, text_ids

DATA = Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "instrument-tiny"
HELDOUT = DATA / "instrument-heldout.txt"


@pytest.fixture(scope="module")
def ids():
    return text_ids(TINY, HELDOUT)


@pytest.fixture(scope="module")
def reference(ids):
    ppl, n = perplexity(reference_logits(TINY, ids), ids)
    assert n == len(ids) - 1 > 1000
    assert ppl < 150, f"reference perplexity {ppl:.1f}: the committed checkpoint does not look trained"
    return ppl


def test_engine_perplexity_equals_the_reference(ids, reference):
    ppl, _ = perplexity(engine_logits(TINY, ids), ids)
    print(f"engine {ppl:.3f} vs transformers fp32 {reference:.3f}")
    assert abs(ppl / reference - 1) < 0.01


def test_streaming_perplexity_with_a_cache_of_ten_percent(ids, reference, tmp_path):
    from expert_store.reader import ExpertStore
    from tools.repack import main as repack
    store = tmp_path / "store"
    assert repack(["--model", str(TINY), "--out", str(store), "--no-progress"]) in (0, None)
    st = ExpertStore.open(store)
    cache_mb = 0.10 * len(st.moe_layers) * st.n_experts * st.block_stride / 2**20
    # one prefill: each layer needs most of its 32 experts and the cache holds 12 blocks, so it evicts
    # within every layer (prefilling in chunks re-reads everything per chunk: slow on a CPU, same result)
    ppl, _ = perplexity(engine_logits(TINY, ids, store=str(store), cache_mb=cache_mb), ids)
    print(f"streaming, cache {cache_mb:.3f} MiB: {ppl:.3f} vs {reference:.3f}")
    assert abs(ppl / reference - 1) < 0.01


def test_nibble_swapped_weights_are_more_than_ten_times_worse(ids, reference, tmp_path):
    """The must-fail twin of the two checks above."""
    swapped = copy_with_swapped_nibbles(TINY, tmp_path / "swapped")
    ppl, _ = perplexity(engine_logits(swapped, ids), ids)
    print(f"nibble-swapped {ppl:.1f} vs {reference:.2f}")
    assert ppl > 10 * reference


def test_command_prints_ppl_and_tokens_last(ids, reference):
    r = subprocess.run([sys.executable, "-m", "tools.ppl", "--model", str(TINY), "--text-file", str(HELDOUT),
                        "--max-tokens", "600"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["tokens"] == 599 and last["ppl"] == pytest.approx(perplexity(engine_logits(TINY, ids[:600]),
                                                                            ids[:600])[0], rel=1e-6)
    bad = subprocess.run([sys.executable, "-m", "tools.ppl", "--model", str(TINY), "--text-file", "/nonexistent"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "/nonexistent" in bad.stderr
