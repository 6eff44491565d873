"""The compute process's reader thread on a real socket: typed messages in, a clear error out for a request it
cannot read (and nothing queued for it), while well-formed messages keep working."""
from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import msgpack

from gpu_worker.worker import Channel, Worker
from procs import messages as m


def replies(sock, n):
    u = m.unpacker()
    out = []
    while len(out) < n:
        u.feed(sock.recv(1 << 16))
        out += [m.decode(o, m.TO_LAUNCHER) for o in u]
    return out


def test_a_malformed_request_is_answered_with_an_error_naming_it():
    ours, theirs = socket.socketpair()
    w = Worker(SimpleNamespace(model=None, prefill_budget_bytes=None), Channel(theirs))
    w.stats = lambda: m.EngineStats(requests={"requests": 7})
    t = threading.Thread(target=w.read_loop, daemon=True)
    t.start()
    bad = {"op": "generate", "id": "r1", "prompt_ids": [1, 2], "params": {"top_p": 2.0}}
    ours.sendall(msgpack.packb(bad) + msgpack.packb({"op": "what"}) + m.encode(m.StatsRequest(3)))
    err, stats = replies(ours, 2)
    assert err == m.Error("r1", "the request could not be read: generate.params: top_p must be in (0, 1]")
    assert stats == m.StatsReply(3, m.EngineStats(requests={"requests": 7}))   # the unknown op was skipped
    good = {**bad, "params": {"top_p": 0.5}}                                    # the twin: well formed, queued
    ours.sendall(msgpack.packb(good) + m.encode(m.Shutdown()))
    t.join(10)
    assert w.jobs.get_nowait().params.top_p == 0.5
    assert w.jobs.get_nowait() is None and w.jobs.empty()
    ours.close(), theirs.close()
