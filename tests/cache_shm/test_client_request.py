"""`CacheClient.request`: the decode's layer message as a fixed record (u16 ids, `layer_record`) wherever it can carry
them, else msgpack (the route's lists of Python ints packed as they are, anything else converted). The prefetcher reads
the same message of ints (`decode_message`) either way."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from cache_shm import client as client_mod
from cache_shm.client import LAYER_RECORD_TAG, MSG_LAYER, CacheClient, decode_message
from cache_shm.shm import CLC, CacheShm
from moestream_fake_store import make_fake_store


@pytest.fixture()
def shm(tmp_path):
    shm = CacheShm.create(make_fake_store(tmp_path, n_layers=3, n_experts=64), n_slots=80, n_workers=1)
    yield shm
    shm.close()


def sent(shm) -> list:
    out = []
    while (m := shm.msg_ring.pop()) is not None:
        out.append(decode_message(m))
    return out


def as_floats(x):
    return float(x) if np.ndim(x) == 0 else [float(e) for e in x]


def no_record(n_ids):
    raise ValueError("no record")     # what the client sees for a message the record cannot carry


def msgpack_only(monkeypatch):
    """Every layer message by msgpack: no record, none cached by an earlier test (the client reads its cache of
    records before it asks `layer_record`)."""
    monkeypatch.setattr(client_mod, "layer_record", no_record)
    monkeypatch.setattr(client_mod, "_LAYER_RECORDS", {})


@pytest.mark.parametrize("converts", [True, False])
def test_request_sends_ints_whatever_it_was_given(shm, monkeypatch, converts):
    """msgpack's path (a message the record cannot carry): every form's message unpacks to the same ints, each one
    alone (a numpy form first fails to pack: a packer that kept that attempt's bytes would corrupt the message). Twin
    (converts=False): a packer that accepts numpy's ints by turning them into floats; the fast path then sends floats
    (equal to the ints, the wrong type for the prefetcher's indexing), and the check catches it."""
    msgpack_only(monkeypatch)
    c = CacheClient(shm)
    if not converts:
        c._packer = msgpack.Packer(default=as_floats)
    actual, guess = [9, 0, 40], [5, 63]
    forms = [(actual, guess), (np.array(actual), np.array(guess)), ([np.int64(e) for e in actual], tuple(guess)),
             (torch.tensor(actual), torch.tensor(guess)), (range(3), [])]
    for a, g in forms:
        c.request(np.int64(1), a, g)
    msgs = sent(shm)
    want = [(MSG_LAYER, 1, list(map(int, a)), 2, list(map(int, g))) for a, g in forms]
    ok = [tuple(m) for m in msgs] == want and all(type(x) is int for m in msgs for x in [m[1], m[3], *m[2], *m[4]])
    assert ok == converts, msgs
    assert shm.client_counters[CLC["requests"]] == len(forms)


def test_request_splits_a_message_over_the_ring_record(shm):
    """A set too big for one record goes as several messages, every expert once, in order."""
    c = CacheClient(shm)
    big = np.arange(64).repeat(shm.msg_ring.max_payload // 64 + 1)      # numpy ints: the converted path too
    c.request(0, big.tolist(), guess=[], guess_layer=1)
    msgs = sent(shm)
    assert len(msgs) > 1 and all(m[0] == MSG_LAYER and m[1] == 0 and m[3] == 1 for m in msgs)
    assert [e for m in msgs for e in m[2]] == big.tolist()


def drop_last_actual(push):
    """A ring push of layer records that leaves the last actual expert out (the twin: a dropped miss)."""
    def push_packed(st, tag, kind, layer, guess_layer, n_actual, *ids):
        if n_actual:
            ids = ids[:n_actual - 1] + ids[n_actual:]
            n_actual -= 1
            st = client_mod.layer_record(len(ids))
        return push(st, tag, kind, layer, guess_layer, n_actual, *ids)
    return push_packed


@pytest.mark.parametrize("faithful", [True, False])
def test_the_layer_record_says_what_msgpack_said(shm, faithful):
    """Layer messages like the decode route's (22 + 22 ids of 512 experts, an empty guess, an empty choice, the tier's
    shorter rest; Python, numpy and torch ints) go as fixed records, and each reads as msgpack's message of the same
    request: the same kind, layer, guess layer and ids, in order, as Python ints. Twin (faithful=False): a push that
    drops the last actual expert, a miss the prefetcher would never read, is caught."""
    c = CacheClient(shm)
    if not faithful:
        c.shm.msg_ring.push_packed = drop_last_actual(c.shm.msg_ring.push_packed)
    rng = np.random.default_rng(1)
    cases = []
    for i in range(40):
        na, ng = [(22, 22), (22, 0), (0, 22), (19, 21), (1, 1)][i % 5]
        actual, guess = rng.choice(512, na, replace=False).tolist(), rng.choice(512, ng, replace=False).tolist()
        form = [list, np.array, torch.tensor][i % 3]
        cases.append((i % 3, form(actual), form(guess), actual, guess))
    raw = []
    for layer, a, g, _, _ in cases:
        c.request(layer, a, g)
        raw.append(c.shm.msg_ring.pop())
    assert all(r[0] == LAYER_RECORD_TAG for r in raw)             # every one went as a record
    got = [decode_message(r) for r in raw]
    want = [msgpack.unpackb(msgpack.packb((MSG_LAYER, layer, actual, (layer + 1) % 3, guess)))
            for layer, _, _, actual, guess in cases]
    ok = got == want and all(type(x) is int for m in got for x in [m[1], m[3], *m[2], *m[4]])
    assert ok == faithful, next(((g, w) for g, w in zip(got, want) if g != w), None)
    assert shm.client_counters[CLC["requests"]] == len(cases)


def test_a_message_the_record_cannot_carry_goes_as_msgpack(shm):
    """An id over u16 and a negative id go as msgpack, unchanged (nothing of the failed record written); a full ring
    takes the same record once there is room."""
    c = CacheClient(shm)
    c.request(0, [70000, 3], [2])
    c.request(1, [-1], [])
    raw = [shm.msg_ring.pop(), shm.msg_ring.pop()]
    assert shm.msg_ring.pop() is None and [r[0] for r in raw] != [LAYER_RECORD_TAG] * 2
    assert [decode_message(r) for r in raw] == [[MSG_LAYER, 0, [70000, 3], 1, [2]], [MSG_LAYER, 1, [-1], 2, []]]
    ring = shm.msg_ring
    while ring.push(b"x"):
        pass
    import threading
    t = threading.Thread(target=c.request, args=(2, [5], [6]))
    t.start()
    t.join(0.05)
    assert t.is_alive()                                 # waiting for room
    while (m := ring.peek()) == b"x":
        ring.advance()
    t.join(5)
    assert not t.is_alive() and decode_message(ring.pop()) == [MSG_LAYER, 2, [5], 0, [6]]
