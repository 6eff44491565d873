"""The decode step cut into segments (graphs between MoE layers; experts and attention eager) against the plain
forward: same logits token by token, with two sequences decoded in turns (the static Mamba states are bound to
one sequence at a time) and a prefill in between. On the CPU the segments run eagerly with the fused kernels
under Triton's interpreter; on CUDA they are captured (also run here when a GPU is present)."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.decode_graphs import DecodeGraphs
from kernels import backend
from nemotron import mamba
from nemotron.model import NemotronH

# forcing the fused kernels on CPU tensors needs Triton's interpreter, which is on only where there is no GPU
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
FUSED = {"mamba_step": "triton", "attention_decode": "triton"}


@pytest.fixture(scope="module")
def ckpt_dir(synth):
    return synth("tiny", "bf16", 4)


def run(model, steps=5, fixed=False):
    """Two sequences decoded in turns, a third prefilled in the middle; greedy (or, with `fixed`, given tokens,
    so that a near tie cannot fork the two runs); logits of every step."""
    out = []
    a, b = model.new_state(), model.new_state()
    la = model.forward(list(range(30, 50)), a, last_only=True)
    lb = model.forward(list(range(60, 71)), b, last_only=True)
    for t in range(steps):
        la = model.forward([5 + 7 * t if fixed else int(la[-1].argmax())], a, last_only=True)
        lb = model.forward([11 + 5 * t if fixed else int(lb[-1].argmax())], b, last_only=True)
        out += [la, lb]
        if t == 2:
            c = model.new_state()
            out.append(model.forward(list(range(5, 17)), c, last_only=True))
            out.append(model.forward([3], c, last_only=True))
            a2 = a.clone()                       # a clone of the bound sequence stays independent of it
            out.append(model.forward([9], a2, last_only=True))
    return torch.cat([o.float().cpu() for o in out])


@pytest.mark.parametrize("device", DEVICES)
def test_segmented_decode_equals_plain_forward(ckpt_dir, device, monkeypatch):
    monkeypatch.setattr(backend, "FORCED", FUSED)
    model = NemotronH(ckpt_dir, device=device, dtype=torch.float32)
    plain = run(model)
    model.decode_graphs = g = DecodeGraphs(model)
    kinds = [seg[0] for seg in g.segments]
    assert "route" in kinds and "attn" in kinds and kinds.count("graph") >= 3
    segmented = run(model)
    assert plain.abs().max() > 0.1
    assert torch.allclose(plain, segmented, atol=1e-5, rtol=1e-5), (plain - segmented).abs().max()
    if device == "cuda":        # every stretch and every S_j captured (the in-memory source: eager variant only)
        assert g.captures == kinds.count("graph") + kinds.count("route")


@pytest.mark.parametrize("device", DEVICES)
def test_twin_state_not_copied_in_is_caught(ckpt_dir, device, monkeypatch):
    """Must-fail twin: binding that re-points a sequence at the static states without copying its own in."""
    monkeypatch.setattr(backend, "FORCED", FUSED)
    model = NemotronH(ckpt_dir, device=device, dtype=torch.float32)
    plain = run(model, steps=2)
    model.decode_graphs = g = DecodeGraphs(model)

    def careless_bind(state):
        for i, sb in g.static.items():
            state.layers[i].ssm, state.layers[i].conv = sb.ssm, sb.conv
    monkeypatch.setattr(g, "_bind", careless_bind)
    assert (plain - run(model, steps=2)).abs().max() > 1e-2


def test_clamped_dt_is_refused(ckpt_dir):
    model = NemotronH(ckpt_dir, dtype=torch.float32)
    next(m for m in model.mixers if isinstance(m, mamba.Mamba2Mixer)).dt_max = 0.1
    assert "clamps dt" in DecodeGraphs.unsupported(model)
    with pytest.raises(ValueError, match="clamps dt"):
        DecodeGraphs(model)


# The cache-pipeline tests below force what CUDA does (fused kernels, blocks by address) on the CPU, which needs
# Triton's interpreter; a GPU machine runs the same paths for real in bench/gpu_session.sh's `check` step.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU variant: the interpreter is off where a GPU is")


@pytest.fixture(scope="module")
def store(synth, tmp_path_factory):
    from io_workers.store import ExpertStore
    from tools import repack
    out = tmp_path_factory.mktemp("graphs") / "store"
    assert repack.main(["--model", str(synth("tiny", "nvfp4", 0)), "--out", str(out), "--no-progress"]) == 0
    st = ExpertStore.open(out)
    return out, len(st.moe_layers) * st.n_experts, st.block_stride


def engine(store, blocks: int, addressed: bool):
    from gpu_worker.engine import StreamingEngine
    path, _, stride = store
    eng = StreamingEngine(path, cache_bytes=blocks * stride, io_workers=2)
    if addressed:       # as on CUDA: the Triton kernels read blocks by address and count the down groups
        eng.experts._addressed = True
        eng.experts._down_groups = torch.zeros(1, dtype=torch.int32)
    return eng


@cpu_only
def test_segmented_decode_through_the_cache_pipeline(store, monkeypatch):
    """The streaming source's split API (route on the host, then compute, with pins deferred past the kernels)
    with a cache of a tenth of the experts: same logits as the engine's plain forward."""
    monkeypatch.setattr(backend, "FORCED", FUSED)
    with engine(store, max(store[1] // 10, 8), addressed=False) as eng:
        plain = run(eng.model, steps=3, fixed=True)
        eng.model.decode_graphs = g = DecodeGraphs(eng.model)
        segmented = run(eng.model, steps=3, fixed=True)
        assert eng.sup.client().stats()["evictions"] > 0
    assert set(g.variant.values()) == {"eager"}
    # hits first, then misses in landing order: the fp32 sum's order follows the IO workers' timing
    assert torch.allclose(plain, segmented, atol=1e-3, rtol=1e-4), (plain - segmented).abs().max()


@cpu_only
def test_expert_kernels_inside_the_segments(store, monkeypatch):
    """As on CUDA: blocks by address (the Triton kernels, here under the interpreter), and a layer whose experts
    are all present runs them inside the next segment ("slab" variant) instead of eagerly; a cache holding every
    expert makes that the common case, a tenth of them mixes both. Same logits as the plain forward."""
    n = store[1]
    monkeypatch.setattr(backend, "FORCED", FUSED)
    for blocks in (n + 8, max(n // 10, 8)):
        with engine(store, blocks, addressed=True) as eng:
            ex = eng.experts
            plain = run(eng.model, steps=3, fixed=True)
            eng.model.decode_graphs = g = DecodeGraphs(eng.model)
            seen = set()
            real = g._route

            def route(i):
                real(i)
                seen.add(g.variant[i])
            g._route = route
            segmented = run(eng.model, steps=3, fixed=True)
            assert "slab" in seen and (blocks > n or "eager" in seen), seen
            assert ex._deferred == [] or all(c >= 1 for c in ex.client._pins[ex._deferred])
        # With a small cache, which experts of a layer run in one launch and which land later depends on the IO
        # workers' timing, so fp32 sums are added in different orders (measured up to 6e-4 on logits of ~10);
        # the must-fail twin below differs by far more than this tolerance.
        assert torch.allclose(plain, segmented, atol=3e-3, rtol=1e-3), (blocks, (plain - segmented).abs().max())


@cpu_only
def test_twin_kernels_skipped_in_the_slab_variant_is_caught(store, monkeypatch):
    """Must-fail twin: a segment that forgets the expert kernels in the "slab" variant changes the logits."""
    monkeypatch.setattr(backend, "FORCED", FUSED)
    with engine(store, store[1] + 8, addressed=True) as eng:
        plain = run(eng.model, steps=2, fixed=True)
        eng.model.decode_graphs = DecodeGraphs(eng.model)
        monkeypatch.setattr("gpu_worker.decode_graphs.moe_ops",
                            type("NoKernels", (), {"expert_decode": staticmethod(lambda *a, **k: None)}))
        broken = run(eng.model, steps=2, fixed=True)
    assert (plain - broken).abs().max() > 3e-2
