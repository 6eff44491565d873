"""The compute process's restarts come from a sliding window too (issue 16.2): 20 deaths within 300 s end the
server with a reason; deaths spread over a longer time never do (before, the 21st death in the server's whole
life was fatal)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

from server.worker_client import WorkerClient, WorkerConfig


class Clock:
    t = 5000.0

    def __call__(self):
        return self.t


def run_deaths(gaps_s: list[float], monkeypatch) -> tuple[WorkerClient, int]:
    """A client whose compute process dies once per gap (a real process that already exited stands in); how many
    times it was restarted."""
    import server.worker_client as wc
    monkeypatch.setattr(wc, "kill_group", lambda proc, sig: None)     # its pid may be anyone's by now
    clock = Clock()
    c = WorkerClient(WorkerConfig(store="unused", cache_bytes=1), log=lambda s: None)
    c.restart_budget.clock = clock
    c.state = "ready"
    spawned = []

    async def spawn():
        spawned.append(1)
        c.state = "ready"            # as if it came back
    c._spawn = spawn
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    async def go():
        for gap in gaps_s:
            clock.t += gap
            if c.state == "failed":
                break
            await c._on_exit(dead)
    asyncio.run(go())
    return c, len(spawned)


def test_twenty_one_quick_deaths_are_fatal_with_a_reason(monkeypatch):
    c, spawned = run_deaths([1.0] * 21, monkeypatch)
    assert spawned == 20 and c.state == "failed", (spawned, c.state)
    assert "after 20 restarts within 300 s" in c.fatal, c.fatal


def test_deaths_spread_over_a_longer_time_are_restarted_every_time(monkeypatch):
    """The twin: 40 deaths 20 s apart (at most 15 in any 300 s)."""
    c, spawned = run_deaths([20.0] * 40, monkeypatch)
    assert spawned == 40 and c.state == "ready" and c.fatal is None, (spawned, c.state, c.fatal)
