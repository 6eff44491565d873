"""How often a dead child process may come back: a budget of restarts over a sliding window, with a backoff that
grows while deaths come in quick succession. A child that keeps dying (a crash at start, a disk that fails every
read) is given up on within the window, instead of being restarted forever or, as before, 20 times in the
server's life and then silently never again. The cache supervisor keeps one per kind of cache process (from the
environment, below); the launcher one for the compute process.

    MOESTREAM_CACHE_RESTARTS="20/300"      at most 20 restarts of one kind of process in any 300 s (the default)
    MOESTREAM_CACHE_BACKOFF="0.1/5"        wait 0.1 s before a restart, doubling per restart in the window, at most
                                           5 s (the default)
"""
from __future__ import annotations

import os
import time
from collections import deque

DEFAULT_RESTARTS, DEFAULT_WINDOW_S = 20, 300.0
DEFAULT_BACKOFF_S, DEFAULT_BACKOFF_CAP_S = 0.1, 5.0


def _pair(name: str, default: tuple[float, float]) -> tuple[float, float]:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        a, b = (float(v) for v in raw.split("/"))
        if a < 0 or b <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected two positive numbers as A/B, e.g. "
                         f"{default[0]:g}/{default[1]:g}") from None
    return a, b


class RestartBudget:
    def __init__(self, max_restarts: int = DEFAULT_RESTARTS, window_s: float = DEFAULT_WINDOW_S,
                 backoff_s: float = DEFAULT_BACKOFF_S, backoff_cap_s: float = DEFAULT_BACKOFF_CAP_S, clock=None):
        self.max_restarts, self.window_s = int(max_restarts), float(window_s)
        self.backoff_s, self.backoff_cap_s = backoff_s, backoff_cap_s
        self.clock = clock or time.monotonic
        self.times: deque[float] = deque()
        self.total = 0

    @classmethod
    def from_env(cls) -> "RestartBudget":
        n, window = _pair("MOESTREAM_CACHE_RESTARTS", (DEFAULT_RESTARTS, DEFAULT_WINDOW_S))
        base, cap = _pair("MOESTREAM_CACHE_BACKOFF", (DEFAULT_BACKOFF_S, DEFAULT_BACKOFF_CAP_S))
        return cls(int(n), window, base, cap)

    def _trim(self, now: float) -> None:
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()

    def recent(self) -> int:
        self._trim(self.clock())
        return len(self.times)

    def allow(self) -> float | None:
        """Record a restart and return how long to wait before it; None when the budget is spent (give up)."""
        now = self.clock()
        self._trim(now)
        if len(self.times) >= self.max_restarts:
            return None
        delay = min(self.backoff_s * 2 ** len(self.times), self.backoff_cap_s) if self.backoff_s else 0.0
        self.times.append(now)
        self.total += 1
        return delay

    def describe(self) -> str:
        return f"{self.max_restarts} restarts in {self.window_s:g} s"
