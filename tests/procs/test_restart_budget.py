"""The restart budget of the cache processes (issue 16.2): a sliding window, not a lifetime count, and a backoff
that grows while deaths come quickly."""
from __future__ import annotations

import pytest

from procs.restart_budget import RestartBudget


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_the_budget_slides():
    clock = Clock()
    b = RestartBudget(3, window_s=10.0, backoff_s=0.0, clock=clock)
    assert [b.allow() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.allow() is None                       # a fourth within 10 s: give up
    clock.t += 10.5                                # the first three have left the window
    assert b.allow() == 0.0 and b.recent() == 1
    for _ in range(30):                            # slow deaths never exhaust it (a lifetime count would)
        clock.t += 4.0
        assert b.allow() is not None
    assert b.total == 34


def test_backoff_doubles_up_to_its_cap_and_resets_with_the_window():
    clock = Clock()
    b = RestartBudget(10, window_s=60.0, backoff_s=0.1, backoff_cap_s=0.5, clock=clock)
    assert [b.allow() for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    clock.t += 61
    assert b.allow() == pytest.approx(0.1)


def test_from_env(monkeypatch):
    monkeypatch.setenv("MOESTREAM_CACHE_RESTARTS", "7/30")
    monkeypatch.setenv("MOESTREAM_CACHE_BACKOFF", "0/1")
    b = RestartBudget.from_env()
    assert (b.max_restarts, b.window_s, b.backoff_s) == (7, 30.0, 0.0)
    monkeypatch.setenv("MOESTREAM_CACHE_RESTARTS", "seven")
    with pytest.raises(ValueError, match="MOESTREAM_CACHE_RESTARTS='seven': expected two positive numbers"):
        RestartBudget.from_env()
