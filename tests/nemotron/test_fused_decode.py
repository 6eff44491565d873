"""The model's decode step with the fused Triton kernels (Mamba conv + state update, attention decode, router) wired
in, as CUDA runs it, against the plain-PyTorch path: same logits, same states. Forced on the CPU here (Triton's
interpreter); the kernels themselves are tested against their twins in tests/kernels."""
from __future__ import annotations

import pytest
import torch

from kernels import backend
from nemotron import mamba
from nemotron.model import NemotronH


# forcing the fused kernels on CPU tensors needs Triton's interpreter, which is on only where there is no GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model(synth):
    return NemotronH(synth("tiny", "bf16", 2), device=DEVICE, dtype=torch.float32)


def decode(model, ids, steps, fused, monkeypatch):
    path = "triton" if fused else "twin"
    monkeypatch.setattr(backend, "FORCED", {"mamba_step": path, "attention_decode": path, "router": path})
    st = model.new_state()
    out = [model.forward(ids, st, last_only=True)]
    for t in range(steps):
        out.append(model.forward([int(out[-1][-1].argmax()) if t % 2 else 7 + t], st, last_only=True))
    return torch.cat(out).cpu(), st


def test_fused_decode_equals_plain(model, monkeypatch):
    ids = list(range(20, 45))
    plain, st_p = decode(model, ids, 4, False, monkeypatch)
    fused, st_f = decode(model, ids, 4, True, monkeypatch)
    assert plain.abs().max() > 0.1
    assert torch.allclose(plain, fused, atol=2e-4, rtol=1e-4), (plain - fused).abs().max()
    kinds = {type(s).__name__ for s in st_p.layers if s is not None}
    assert {"MambaState", "KVCache"} <= kinds          # both fused paths ran
    for a, b in zip(st_p.layers, st_f.layers):
        if isinstance(a, mamba.MambaState):
            assert torch.allclose(a.ssm, b.ssm, atol=1e-4, rtol=1e-4)
            assert torch.allclose(a.conv, b.conv, atol=1e-4, rtol=1e-4)


def test_twin_wrong_state_layout_is_caught(model, monkeypatch):
    """Must-fail twin: the state update fed B and C swapped (a plausible wiring slip) changes the output."""
    ids = list(range(20, 45))
    plain, _ = decode(model, ids, 2, False, monkeypatch)
    real = mamba.mamba_step.selective_state_update
    monkeypatch.setattr(mamba.mamba_step, "selective_state_update",
                        lambda state, x, dt, dtb, A, B, C, D: real(state, x, dt, dtb, A, C, B, D))
    fused, _ = decode(model, ids, 2, True, monkeypatch)
    assert (plain - fused).abs().max() > 1e-2


def test_twin_router_weights_misaligned_is_caught(model, monkeypatch):
    """Must-fail twin: the fused router's weights paired with the wrong experts (reversed along the top-k), a
    plausible slip of its output order, changes the output."""
    from nemotron import moe
    ids = list(range(20, 45))
    plain, _ = decode(model, ids, 2, False, monkeypatch)
    real = moe.route_rows

    def misaligned(*a, **kw):
        ex, wt = real(*a, **kw)
        return ex, wt.flip(-1)
    monkeypatch.setattr(moe, "route_rows", misaligned)
    fused, _ = decode(model, ids, 2, True, monkeypatch)
    assert (plain - fused).abs().max() > 1e-2
