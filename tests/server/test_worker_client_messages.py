"""The launcher's side of the messages: what the compute process sends reaches the request it is for, typed; an
unreadable message fails that request with a message naming the field, instead of leaving it waiting."""
from __future__ import annotations

import msgpack

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
