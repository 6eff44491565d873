"""The decode step cut into segments (graphs between MoE layers; experts and attention eager) against the plain
forward: same logits token by token, with two sequences decoded in turns (the static Mamba states are bound to
one sequence at a time) and a prefill in between. On the CPU the segments run eagerly with the fused kernels
under Triton's interpreter; on CUDA they are captured (also run here when a GPU is present)."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.decode_graphs import DecodeGraphs
from nemotron import mamba
from nemotron.model import NemotronH

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def ckpt_dir(synth):
    return synth("tiny", "bf16", 4)


def run(model, steps=5):
    """Two sequences decoded in turns, a third prefilled in the middle; greedy; logits of every step."""
    out = []
    a, b = model.new_state(), model.new_state()
    la = model.forward(list(range(30, 50)), a, last_only=True)
    lb = model.forward(list(range(60, 71)), b, last_only=True)
    for t in range(steps):
        la = model.forward([int(la[-1].argmax())], a, last_only=True)
        lb = model.forward([int(lb[-1].argmax())], b, last_only=True)
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
    monkeypatch.setattr(mamba, "use_fused_decode", lambda h: True)
    model = NemotronH(ckpt_dir, device=device, dtype=torch.float32)
    plain = run(model)
    model.decode_graphs = g = DecodeGraphs(model)
    kinds = [k for k, _ in g.segments]
    assert "experts" in kinds and "attn" in kinds and kinds.count("graph") >= 3
    segmented = run(model)
    assert plain.abs().max() > 0.1
    assert torch.allclose(plain, segmented, atol=1e-5, rtol=1e-5), (plain - segmented).abs().max()
    if device == "cuda":
        assert g.captures == kinds.count("graph")


def test_twin_state_not_copied_in_is_caught(ckpt_dir, monkeypatch):
    """Must-fail twin: binding that re-points a sequence at the static states without copying its own in."""
    monkeypatch.setattr(mamba, "use_fused_decode", lambda h: True)
    model = NemotronH(ckpt_dir, dtype=torch.float32)
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
