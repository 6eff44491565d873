"""tools.coactivation: the greedy finds planted co-activation groups; a permuted BF16 checkpoint gives the same
logits (and permuting up without down is caught); an NVFP4 checkpoint is refused without --requantize, and
with it up moves bit for bit while down is re-encoded within its quantization step."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kernels.nvfp4 import decode_nvfp4
from nemotron.checkpoint import Checkpoint
from nemotron.model import NemotronH
from tools.coactivation import (SUMMARY, NeedsRequantize, coactivation_order, groups_read, main,
                                order_checkpoint)


def _ids(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(14, 1000, size=n)]


def _logits(model_dir, ids):
    m = NemotronH(model_dir)
    return m.forward(ids, m.new_state())


def _tensors(model_dir):
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_greedy_recovers_planted_groups():
    g = torch.Generator().manual_seed(0)
    T, I = 400, 64
    scatter = torch.randperm(I, generator=g)                 # planted group k = neurons scatter[16k:16k+16]
    fired = torch.zeros(T, I, dtype=torch.bool)
    cluster = torch.randint(0, I // 16, (T,), generator=g)
    for t in range(T):
        members = scatter[16 * cluster[t]:16 * cluster[t] + 16]
        fired[t, members[torch.rand(16, generator=g) < 0.5]] = True   # a random half of one planted group
    perm = coactivation_order(fired)
    assert sorted(perm.tolist()) == list(range(I))
    assert groups_read(fired, perm, 16) == int(fired.any(1).sum())    # one group per token: the optimum
    assert groups_read(fired, torch.arange(I), 16) > 2 * int(fired.any(1).sum())
    # the planted groups come back whole
    assert {frozenset(perm[16 * k:16 * k + 16].tolist()) for k in range(4)} == \
           {frozenset(scatter[16 * k:16 * k + 16].tolist()) for k in range(4)}


def test_bf16_order_is_exact_and_up_without_down_is_caught(synth, tmp_path):
    src = synth("tiny", "bf16")
    calib, held = _ids(1, 48), _ids(2, 24)
    s = order_checkpoint(src, calib, tmp_path / "ordered")
    moved = [k for k, p in s["perms"].items() if p != sorted(p)]
    assert moved and all(sorted(p) == list(range(len(p))) for p in s["perms"].values())
    assert json.loads((tmp_path / "ordered" / SUMMARY).read_text())["perms"] == s["perms"]
    assert s["calibration_groups_read"]["ordered"][16] < s["calibration_groups_read"]["unordered"][16]
    ref = _logits(src, held)
    out = _logits(tmp_path / "ordered", held)
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-5
    # the same routed experts' tensors, permuted: not a copy of the input
    a, b = _tensors(src), _tensors(tmp_path / "ordered")
    layer, e = (int(x) for x in moved[0].split("."))
    up = Checkpoint.expert_module(layer, e, "up") + ".weight"
    assert not torch.equal(a[up], b[up]) and torch.equal(a[up][torch.tensor(s["perms"][moved[0]])], b[up])

    order_checkpoint(src, calib, tmp_path / "up-only", permute_down=False)    # the must-fail twin
    broken = _logits(tmp_path / "up-only", held)
    assert float((broken - ref).abs().max() / ref.abs().max()) > 1e-2


def test_nvfp4_needs_requantize_and_requantizes_down_only(synth, tmp_path):
    src = synth("tiny", "nvfp4")
    calib = _ids(3, 48)
    with pytest.raises(NeedsRequantize, match="--requantize"):
        order_checkpoint(src, calib, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    assert main(["--model", str(src), "--text-file", str(src / "tokenizer.json"), "--out",
                 str(tmp_path / "refused-cli"), "--max-tokens", "16"]) == 1

    s = order_checkpoint(src, calib, tmp_path / "ordered", requantize=True)
    assert s["requantized_down"] == len(s["perms"])
    a, b = _tensors(src), _tensors(tmp_path / "ordered")
    for key, p in s["perms"].items():
        if p == sorted(p):
            continue
        layer, e = (int(x) for x in key.split("."))
        perm = torch.tensor(p)
        up, down = (Checkpoint.expert_module(layer, e, x) for x in ("up", "down"))
        assert torch.equal(a[up + ".weight"][perm], b[up + ".weight"])            # up: exact
        assert torch.equal(a[up + ".weight_scale"].view(torch.uint8)[perm], b[up + ".weight_scale"].view(torch.uint8))
        assert torch.equal(a[down + ".weight_scale_2"], b[down + ".weight_scale_2"])
        want = decode_nvfp4(a[down + ".weight"], a[down + ".weight_scale"], a[down + ".weight_scale_2"])[:, perm]
        got = decode_nvfp4(b[down + ".weight"], b[down + ".weight_scale"], b[down + ".weight_scale_2"])
        assert not torch.equal(want, got)                                         # regrouped: requantized
        # each element within one e2m1 step of its new group (steps are at most 2 units of scale·global)
        step = 2 * (b[down + ".weight_scale"].float() * b[down + ".weight_scale_2"]).repeat_interleave(16, 1)
        assert bool(((want - got).abs() <= step + 1e-12).all())
        break
    else:
        raise AssertionError("no expert was moved")


def test_nvfp4_identity_requantize_is_bit_exact(synth, tmp_path):
    """The re-encoding itself loses nothing on a ModelOpt-encoded checkpoint: what the order costs is the
    regrouping alone."""
    src = synth("tiny", "nvfp4")
    order_checkpoint(src, _ids(4, 16), tmp_path / "same", order="identity", requantize=True)
    a, b = _tensors(src), _tensors(tmp_path / "same")
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), k


def test_order_never_reads_more_than_the_frequency_sort_in_sample():
    g = torch.Generator().manual_seed(1)
    rate = torch.rand(48, generator=g) * 0.6                   # dense, unequal firing rates: the sort's case
    fired = torch.rand(120, 48, generator=g) < rate
    by_freq = torch.sort(fired.float().sum(0), descending=True, stable=True).indices
    perm = coactivation_order(fired)
    assert sorted(perm.tolist()) == list(range(48))
    assert groups_read(fired, perm, 16) <= groups_read(fired, by_freq, 16)
    assert groups_read(fired, coactivation_order(fired, refine_passes=0), 16) >= groups_read(fired, perm, 16)


INSTRUMENT = Path(__file__).resolve().parents[1] / "data" / "instrument-tiny"
HELDOUT = INSTRUMENT.parent / "instrument-heldout.txt"


def test_trained_instrument_reads_fewer_groups_held_out_at_a_small_cost(tmp_path):
    """On trained weights the order found on one half of the held-out text reads fewer 16-neuron groups on
    the other half, and the NVFP4 requantization it needs moves the output by little."""
    from bench.coactivation import kl_mean
    from bench.down_groups import measure, token_ids
    ids = token_ids(INSTRUMENT, HELDOUT.read_text(), None, 10 ** 9)
    calib, held = ids[:256], ids[len(ids) // 2:][:128]
    order_checkpoint(INSTRUMENT, calib, tmp_path / "ordered", requantize=True)
    lo_ref, lo = [], []
    ref = measure(INSTRUMENT, held, logits_out=lo_ref)
    got = measure(tmp_path / "ordered", held, logits_out=lo)
    assert got["rows"][0]["groups_read_per_token"] < 0.95 * ref["rows"][0]["groups_read_per_token"]
    assert kl_mean(torch.cat(lo_ref), torch.cat(lo)) < 1e-5


def test_expert_straddling_two_shards_is_permuted_whole(synth, tmp_path):
    """Real checkpoints cut shards anywhere: an expert whose down sits in another shard than its up."""
    import shutil

    from safetensors.torch import save_file
    src = tmp_path / "straddle"
    shutil.copytree(synth("tiny", "bf16"), src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    layer = Checkpoint(src).config.moe_layers[0]
    moved = 0
    for e in range(Checkpoint(src).config.n_routed_experts):
        name = Checkpoint.expert_module(layer, e, "down") + ".weight"
        here = index["weight_map"][name]
        there = next(f for f in sorted(set(index["weight_map"].values())) if f != here)
        a, b = load_file(src / here), load_file(src / there)
        b[name] = a.pop(name)
        save_file(a, src / here, metadata={"format": "pt"})
        save_file(b, src / there, metadata={"format": "pt"})
        index["weight_map"][name] = there
        moved += 1
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    held = _ids(6, 16)
    s = order_checkpoint(src, _ids(5, 48), tmp_path / "ordered")
    assert any(p != sorted(p) for k, p in s["perms"].items() if k.startswith(f"{layer}."))
    ref, out = _logits(src, held), _logits(tmp_path / "ordered", held)
    assert moved and float((out - ref).abs().max() / ref.abs().max()) <= 1e-5
