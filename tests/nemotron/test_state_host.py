"""A sequence's state copied to the host and back (what conversation snapshots store): the restored state
continues exactly like the original, the host copy is independent of both, and a copy that does not fit the
model is named, not loaded."""
from __future__ import annotations

import copy

import pytest
import torch

from nemotron.attention import KVCache
from nemotron.mamba import MambaState
from nemotron.model import InferenceState, NemotronH


@pytest.fixture(scope="module")
def model(synth):
    return NemotronH(synth("tiny", "bf16"))


@pytest.fixture(scope="module")
def host_copy(model):
    return prefilled(model).to_host()


def prefilled(model, n=13):
    st = model.new_state()
    model.forward(list(range(40, 40 + n)), st)
    return st


def shares_memory(state: InferenceState, d: dict) -> bool:
    """Does any tensor of `state` live in the storage of a tensor of the host copy `d`?"""
    host = {t.untyped_storage().data_ptr() for s in d["layers"] if s is not None
            for t in s.values() if torch.is_tensor(t)}
    return any(t.untyped_storage().data_ptr() in host for s in state.layers if s is not None
               for t in ((s.conv, s.ssm) if isinstance(s, MambaState) else (s.k, s.v)))


def test_round_trip_continues_like_the_original(model):
    st = prefilled(model)
    d = st.to_host()
    assert all(t.device.type == "cpu" for s in d["layers"] if s is not None for t in s.values() if torch.is_tensor(t))
    assert not shares_memory(st, d)
    assert model.new_state().host_mismatch(d) is None
    back = InferenceState.from_host(d, model.device)
    assert not shares_memory(back, d)    # decoding it (in place, on CUDA) leaves the kept copy as it was
    assert back.position == st.position == 13
    assert {type(s) for s in back.layers if s is not None} == {MambaState, KVCache}
    a = torch.cat([model.forward([t], st) for t in (5, 9, 300)])
    b = torch.cat([model.forward([t], back) for t in (5, 9, 300)])
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_twin_restored_state_sharing_the_host_copy_is_caught(model, monkeypatch):
    """Must-fail twin: a from_host that wraps the host tensors instead of copying them."""
    d = prefilled(model).to_host()
    monkeypatch.setattr(KVCache, "from_host", classmethod(lambda cls, s, device: cls.of(s["k"], s["v"], s["length"])))
    assert shares_memory(InferenceState.from_host(d, model.device), d)


@pytest.mark.parametrize("damage, why", [
    (lambda d, i_m, i_kv: d["layers"][i_m].__setitem__("ssm", d["layers"][i_m]["ssm"][:1]), "ssm shape/dtype"),
    (lambda d, i_m, i_kv: d["layers"][i_m].__setitem__("conv", d["layers"][i_m]["conv"].double()), "conv shape/dtype"),
    (lambda d, i_m, i_kv: d["layers"][i_kv].__setitem__("length", 99), "k shape/dtype"),
    (lambda d, i_m, i_kv: d.__setitem__("position", 3), "k shape/dtype"),        # more cached rows than tokens
    (lambda d, i_m, i_kv: d["layers"].__setitem__(i_m, d["layers"][i_kv]), "not a Mamba state"),
    (lambda d, i_m, i_kv: d["layers"].__setitem__(i_m, None), "kind differs"),
    (lambda d, i_m, i_kv: d["layers"].pop(), "layer count differs"),
    (lambda d, i_m, i_kv: d.__setitem__("position", -1), "bad position"),
], ids=["ssm-shape", "conv-dtype", "kv-length", "kv-beyond-position", "kind-swapped", "layer-missing",
        "layer-count", "position"])
def test_a_copy_that_does_not_fit_is_named(model, host_copy, damage, why):
    d = copy.deepcopy(host_copy)
    assert model.new_state().host_mismatch(d) is None
    i_m = next(i for i, s in enumerate(d["layers"]) if s is not None and s["kind"] == "mamba")
    i_kv = next(i for i, s in enumerate(d["layers"]) if s is not None and s["kind"] == "kv")
    damage(d, i_m, i_kv)
    assert why in (model.new_state().host_mismatch(d) or "")


def test_unknown_state_kind_is_a_clear_error(model, host_copy):
    d = copy.deepcopy(host_copy)
    i = next(i for i, s in enumerate(d["layers"]) if s is not None)
    d["layers"][i] = dict(d["layers"][i], kind="rwkv")
    with pytest.raises(ValueError, match="layer .*: unknown state kind 'rwkv'"):
        InferenceState.from_host(d, model.device)
