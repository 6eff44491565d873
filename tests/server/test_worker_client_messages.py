"""The launcher's side of the messages: what the compute process sends reaches the request it is for, typed; an
unreadable message fails that request with a message naming the field, instead of leaving it waiting."""
from __future__ import annotations

import msgpack
import pytest

from procs import messages as m
from server.worker_client import WorkerClient, WorkerConfig


def running_job(client):
    client.state = "ready"
    job = client.submit(m.Generate("", [1, 2], m.SamplingParams(max_tokens=2)))
    client.queue.popleft()
    job.state, client.running = "running", job       # as _dispatch does once the worker took it
    return job


def test_messages_reach_their_request_and_a_bad_one_fails_it():
    client = WorkerClient(WorkerConfig(store="unused", cache_bytes=1), log=lambda s: None)
    job = running_job(client)
    assert job.msg.id == job.id                      # the client gives the id
    client._on_wire(msgpack.unpackb(m.encode(m.Token(job.id, 5))))
    assert job.events.get_nowait() == m.Token(job.id, 5) and job.state == "running"   # the twin: well formed
    client._on_wire({"op": "token", "id": job.id, "token": "five"})
    err = job.events.get_nowait()
    assert isinstance(err, m.Error) and "token.token: expected an integer, got str" in err.message
    assert job.state == "finished" and client.running is None


def test_the_worker_reads_every_setting_the_launcher_writes():
    """WorkerConfig.args -> gpu_worker.worker.parse_args: the cache's policy, the warm, the reserve arrive as set
    (the twin: a policy the worker does not know is refused by the prefetcher, not here; an unknown flag is)."""
    from gpu_worker.worker import parse_args
    cfg = WorkerConfig(store="s", cache_bytes=5, vram_bytes=7, prefill_reserve_bytes=9, warm_cache="off",
                       cache_policy="lru", model="m", snapshot_dir="d")
    a = parse_args(cfg.args(3))
    assert (a.fd, a.store, a.cache_bytes, a.vram_bytes, a.prefill_reserve_bytes, a.warm_cache, a.cache_policy,
            a.model, a.snapshot_dir) == (3, "s", 5, 7, 9, "off", "lru", "m", "d")
    d = parse_args(WorkerConfig(store="s", cache_bytes=5).args(3))
    assert (d.warm_cache, d.cache_policy, d.prefill_reserve_bytes, d.vram_bytes) == ("auto", "reuse", 0, None)
    with pytest.raises(SystemExit):
        parse_args(cfg.args(3) + ["--no-such-flag"])
