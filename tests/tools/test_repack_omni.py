"""A vision-language (Omni) checkpoint repacks into the same kind of store as a text one: the language model's
tensors under the names the engine reads, the vision tensors beside them in the dense files."""
from __future__ import annotations

import numpy as np

from nemotron.checkpoint import Checkpoint
from nemotron.model import NemotronH
from tools import repack
from tools.logits import logits_and_greedy
from tools.synth_vision import synthesize_omni


def test_omni_checkpoint_repacks_verifies_and_runs_from_the_store(tmp_path):
    model_dir, store = tmp_path / "omni", tmp_path / "store"
    synthesize_omni(model_dir, seed=3)
    assert repack.main(["--model", str(model_dir), "--out", str(store), "--no-progress"]) == 0
    assert repack.main(["--model", str(model_dir), "--verify", str(store)]) == 0
    ck = Checkpoint(store)
    names = ck.tensor_names()
    assert not any(n.startswith("language_model.") for n in names)
    assert any(n.startswith("vision_model.") for n in names) and "lm_head.weight" in names
    ids = [int(t) for t in np.random.default_rng(0).integers(30, 500, size=12)]
    a = logits_and_greedy(NemotronH(model_dir), ids, 4)
    # the store's routed experts are in experts.bin: they stream through the cache pipeline
    from gpu_worker.engine import StreamingEngine
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=1 << 20, io_workers=1) as eng:
        b = logits_and_greedy(eng.model, ids, 4)
    np.testing.assert_allclose(b[0], a[0], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(b[1], a[1])
