"""The streaming engine on a store split into down sub-groups with the Triton expert kernels reading blocks by
address, as on CUDA (here under the interpreter): the prompt's logits (the grouped prefill) and the decode steps'
(expert up, then the sub-group sparse down) equal those of the same checkpoint stored unsplit. Issue 15: on the
H200 a store of 8 or 4 gave 0 % of the unsplit store's greedy tokens from the first token on, while the CPU twins
(which read whole blocks) gave 100 %; the fused prefill path read sub-groups as 16-neuron groups.
Must-fail twin: that prefill (sub-groups read as stored) is caught."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU variant: the interpreter is off where a GPU is (the GPU runs the engine)")
N_DECODE = 1


@pytest.fixture(scope="module")
def stores(synth, tmp_path_factory):
    from tools import repack
    model = synth("tiny", "nvfp4")
    root = tmp_path_factory.mktemp("subk")
    out = {}
    for n in (16, 8):
        out[n] = root / f"n{n}"
        assert repack.main(["--model", str(model), "--out", str(out[n]), "--no-progress",
                            "--down-group-neurons", str(n)]) == 0
    return out


def _logits(store, n_decode=N_DECODE):
    """Prompt logits and greedy-step logits, blocks by address, decode through the segmented step the engine installs
    on CUDA (DecodeGraphs: hits in the "slab" variant, misses eagerly). A cold cache: misses are summed in the
    order they land, which moves fp32 sums by ~1e-7 (a warm-up pass would double the interpreter's time)."""
    from expert_store.reader import ExpertStore
    from gpu_worker.decode_graphs import DecodeGraphs
    from gpu_worker.engine import StreamingEngine
    from gpu_worker.prefill import prefill
    ids = [int(t) for t in np.random.default_rng(7).integers(14, 500, size=12)]
    s = ExpertStore.open(store)
    with StreamingEngine(store, cache_bytes=len(s.moe_layers) * s.n_experts * s.block_stride, io_workers=1) as eng:
        ex = eng.experts
        ex._addressed = True               # as on CUDA: the kernels read the slab by address, count down groups
        ex._down_groups = torch.zeros(1, dtype=torch.int32)
        eng.graphs = DecodeGraphs(eng.model)
        state = eng.model.new_state()
        prompt = prefill(eng.model, ids, state, all_logits=True).float()
        last, greedy, steps = prompt[-1:], [], []
        for _ in range(n_decode):
            greedy.append(int(last[0].argmax()))
            last = eng.step(greedy[-1], state).float()
            steps.append(last)
        assert int(ex._down_groups) > 0 or not n_decode, "the sparse-down kernel did not run"
    gl = torch.cat(steps).numpy() if steps else np.zeros((0, prompt.shape[1]), np.float32)
    return prompt.numpy(), np.array(greedy), gl


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


@pytest.fixture(scope="module")
def plain(stores):
    return _logits(stores[16])


def test_subgroup_kernels_give_the_unsplit_store_logits(stores, plain):
    prompt, greedy, gl = _logits(stores[8])
    # the same bytes reach the prefill GEMMs; the decode sums its (sub-)groups in another order
    assert _rel(prompt, plain[0]) <= 1e-5, _rel(prompt, plain[0])
    np.testing.assert_array_equal(greedy, plain[1])
    assert _rel(gl, plain[2]) <= 1e-5, _rel(gl, plain[2])


def test_must_fail_prefill_reading_subgroups_as_16_neuron_groups(stores, plain, monkeypatch):
    import ctypes

    import kernels.expert_prefill as ep

    def as_stored(addrs, geom, out=None, block_l=128):      # the down section's first bytes, not regrouped
        nb = ep.regrouped_bytes(geom)
        rows = [np.ctypeslib.as_array((ctypes.c_uint8 * nb).from_address(int(a) + geom.down_off)) for a in addrs]
        return torch.from_numpy(np.stack(rows))
    monkeypatch.setattr(ep, "regroup_downs", as_stored)
    prompt, _, _ = _logits(stores[8], n_decode=0)
    assert _rel(prompt, plain[0]) > 1e-2
