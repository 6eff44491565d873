"""Conversation snapshots on their own (no server): the longest proper prefix wins, a restored state continues
exactly like a full prefill, the RAM bounds hold, and a damaged or foreign file on disk is a miss, never a crash."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.snapshots import MAGIC, SnapshotStore, model_key
from nemotron.model import NemotronH


@pytest.fixture(scope="module")
def model(synth):
    return NemotronH(synth("tiny", "nvfp4"))


KEY = model_key("cfg", "fp", torch.float32, "cpu")
# A split prefill and a one-go prefill round differently in fp32 (their chunk boundaries differ): on this model their
# logits (|x| up to ~19) differ by up to 1.1e-5 (main before the batched Mamba scan) / 1.3e-5 (after) over random
# prompts and cuts, so the bound is partly relative. A state restored wrongly differs by O(1).
CONTINUES = dict(rtol=1e-6, atol=1e-5)


def ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(14, 500, size=n)]


def state_after(model, toks):
    st = model.new_state()
    model.forward(toks, st)
    return st


def continue_logits(model, st, tail):
    return model.forward(tail, st)


def store(model, tmp_path=None, **kw):
    return SnapshotStore(KEY, model.new_state, "cpu", directory=tmp_path, **kw)


def test_longest_proper_prefix_and_exact_continuation(model):
    s = store(model)
    a = ids(40)
    s.put(a[:10], state_after(model, a[:10]))
    s.put(a[:25], state_after(model, a[:25]))
    s.put(a[:40], state_after(model, a[:40]))
    r = s.lookup(a[:40])            # a snapshot equal to the prompt leaves nothing to compute logits from
    assert r.n_tokens == 25
    full = continue_logits(model, model.new_state(), a[:40])[-15:]
    np.testing.assert_allclose(continue_logits(model, r.state, a[25:40]).numpy(), full.numpy(), **CONTINUES)
    # the kept snapshot was not advanced by the continuation: a second restore gives the same
    r2 = s.lookup(a[:40])
    np.testing.assert_allclose(continue_logits(model, r2.state, a[25:40]).numpy(), full.numpy(), **CONTINUES)
    assert s.lookup([999] + a) is None                           # the twin: not a prefix -> miss
    assert s.lookup(a[:10]) is None                              # a prefix of the snapshot is not enough


def test_ram_bounds(model):
    one = state_after(model, ids(5))
    s = store(model, max_count=3)
    for k in range(6):
        s.put(ids(5, seed=k), state_after(model, ids(5, seed=k)))
    assert s.info()["in_ram"] == 3 and s.info()["evicted"] == 3
    assert s.lookup(ids(5, seed=5) + [1]) is not None and s.lookup(ids(5, seed=0) + [1]) is None
    from gpu_worker.snapshots import state_bytes
    per = state_bytes(one.to_host())
    s = store(model, max_bytes=int(per * 2.5))
    for k in range(5):
        s.put(ids(5, seed=k), state_after(model, ids(5, seed=k)))
    assert s.info()["in_ram"] == 2 and s.info()["ram_bytes"] <= per * 2.5


def disk_store_with_one(model, tmp_path):
    a = ids(30, seed=1)
    s = store(model, tmp_path)
    s.put(a[:20], state_after(model, a[:20]))
    s.close()
    files = list(tmp_path.glob("*.snap"))
    assert len(files) == 1
    return a, files[0]


def test_disk_round_trip(model, tmp_path):
    a, f = disk_store_with_one(model, tmp_path)
    s = store(model, tmp_path)
    r = s.lookup(a)
    assert r is not None and r.source == "disk" and r.n_tokens == 20
    want = continue_logits(model, model.new_state(), a)[-10:]
    np.testing.assert_allclose(continue_logits(model, r.state, a[20:]).numpy(), want.numpy(), **CONTINUES)
    assert f.name != "".join(map(str, a[:20]))      # names are hashes, never request text


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "bad_magic", "empty", "rename"])
def test_damaged_file_is_a_miss(model, tmp_path, damage):
    a, f = disk_store_with_one(model, tmp_path)
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(data[:len(data) // 2])
    elif damage == "flip_payload":
        data[-100] ^= 0xFF
        f.write_bytes(data)
    elif damage == "flip_header":
        data[20] ^= 0xFF
        f.write_bytes(data)
    elif damage == "bad_magic":
        f.write_bytes(b"XXXXXXXX" + data[8:])
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "rename":
        f.rename(f.with_name("0" * 40 + ".snap"))
    s = store(model, tmp_path)
    assert s.lookup(a) is None
    assert s.info()["bad_files"] >= 1


def test_another_models_file_is_a_miss_and_is_kept(model, tmp_path):
    a, f = disk_store_with_one(model, tmp_path)
    other = SnapshotStore(model_key("cfg", "fp", torch.bfloat16, "cpu"), model.new_state, "cpu", directory=tmp_path)
    assert other.lookup(a) is None
    assert f.exists()                 # not ours to delete
    assert f.read_bytes()[:8] == MAGIC


def test_wrong_shapes_are_a_miss(model, synth, tmp_path):
    """A file whose header matches but whose tensors do not fit the model (e.g. written by a bug) is refused."""
    from gpu_worker.snapshots import encode_file
    a = ids(30, seed=1)
    d = state_after(model, a[:20]).to_host()
    layer = next(i for i, x in enumerate(d["layers"]) if x is not None and x["kind"] == "mamba")
    d["layers"][layer]["ssm"] = d["layers"][layer]["ssm"][:1]
    s = store(model, tmp_path)
    s.path_for(a[:20]).write_bytes(encode_file(KEY, a[:20], d))
    s2 = store(model, tmp_path)
    assert s2.lookup(a) is None and s2.info()["bad_files"] == 1

