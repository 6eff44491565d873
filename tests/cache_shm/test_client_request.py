"""`CacheClient.request` packs the decode route's lists of Python ints as they are and converts anything else
(numpy or torch ints, a range, an array): the prefetcher gets the same message of ints either way."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from cache_shm.client import MSG_LAYER, CacheClient
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
        out.append(msgpack.unpackb(m))
    return out


def as_floats(x):
    return float(x) if np.ndim(x) == 0 else [float(e) for e in x]


@pytest.mark.parametrize("converts", [True, False])
def test_request_sends_ints_whatever_it_was_given(shm, converts):
    """Every form's message unpacks to the same ints, each one alone (a numpy form first fails to pack: a packer that
    kept that attempt's bytes would corrupt the message). Twin (converts=False): a packer that accepts numpy's ints
    by turning them into floats; the fast path then sends floats (equal to the ints, the wrong type for the
    prefetcher's indexing), and the check catches it."""
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
