"""The cache supervisor's restart budget with real processes (issue 16.2): past the budget it gives up loudly
(`failed`, `on_failure`, waits that fail at once instead of a 60 s TimeoutError); deaths spread wider than the
window never exhaust it."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache_shm"))
from moestream_fake_store import make_fake_store  # noqa: E402

from cache_shm.client import CacheUnavailable  # noqa: E402
from cache_shm.names import list_entries, pid_alive  # noqa: E402
from cache_shm.shm import WKC  # noqa: E402
from gpu_worker.cache_supervisor import Supervisor  # noqa: E402
from procs.restart_budget import RestartBudget  # noqa: E402


def wait_until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture()
def sup_of(tmp_path):
    made = []

    def make(max_restarts, window_s):
        store = make_fake_store(tmp_path / f"s{len(made)}", n_layers=2, n_experts=8)
        sup = Supervisor(store, n_slots=8, n_workers=1,
                         restart_budget=lambda: RestartBudget(max_restarts, window_s, 0.01, 0.02)).start()
        made.append(sup)
        return sup
    yield make
    for sup in made:
        pids = sup.child_pids()
        sup.stop()
        assert list_entries(sup.prefix) == [] and not [p for p in pids if pid_alive(p)]


def kill_worker_and_wait_back(sup) -> None:
    old = sup.workers[0].pid
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: sup.failed or (sup.workers[0].pid != old and
                                      int(sup.shm.worker_counters[0, WKC["ready"]]) == 1 and
                                      int(sup.shm.worker_counters[0, WKC["pid"]]) == sup.workers[0].pid),
               20, "the io worker to come back")


def test_past_the_budget_the_supervisor_gives_up_and_waits_fail_at_once(sup_of):
    sup = sup_of(3, 60.0)
    told = []
    sup.on_failure = told.append
    client = sup.client()
    for _ in range(3):
        kill_worker_and_wait_back(sup)
    assert sup.failed is None and sup.restarts["workers"] == 3
    os.kill(sup.workers[0].pid, signal.SIGKILL)                  # the fourth death within the window
    wait_until(lambda: sup.failed is not None, 10, "the supervisor to give up")
    assert "io worker 0 died again" in sup.failed and "3 restarts in 60 s" in sup.failed, sup.failed
    # (the monitor thread sets `failed` before it calls `on_failure`: wait for the call, not only the flag)
    wait_until(lambda: told, 10, "the owner to be told")
    assert told == [sup.failed]
    t0 = time.monotonic()
    with pytest.raises(CacheUnavailable, match="cannot be kept alive"):
        client.request(0, [1])
        client.wait(0, 1, timeout=60)
    assert time.monotonic() - t0 < 1.0


def test_deaths_spread_wider_than_the_window_never_exhaust_it(sup_of):
    """The twin: the same budget over a 1 s window, deaths 1.2 s apart: restarted every time (a lifetime count
    of 3 would have stopped after the third)."""
    sup = sup_of(3, 1.0)
    for _ in range(5):
        t0 = time.monotonic()
        kill_worker_and_wait_back(sup)
        time.sleep(max(0.0, 1.2 - (time.monotonic() - t0)))
    assert sup.failed is None and sup.restarts["workers"] == 5
    client = sup.client()
    client.request(1, [2])
    assert client.wait(1, 2, timeout=20) >= 0
