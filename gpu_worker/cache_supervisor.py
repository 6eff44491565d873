"""Starts and watches the cache's processes: one prefetcher and N IO workers for a store and a slab.

The compute process owns them (`StreamingEngine` runs one of these); a test or a benchmark may too. It
owns the run's shared memory: `stop()` (also at exit and on SIGTERM) terminates every child and
unlinks every object. Children die with their parent too (`procs.spawn.die_with_parent` plus a
parent-pid check), so a SIGKILLed owner leaves only shared memory, which the next start's
`sweep_stale()` removes. Whether a dead child comes back is decided in one place, `_restart`: within a
`RestartBudget` per kind of process (restarts over a sliding window, after a growing backoff). Past it the
supervisor gives up: `failed` says why, the client's waits fail at once, and `on_failure(why)` tells the owner
(the compute process reports it to the launcher and exits, and the launcher exits non-zero).
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time

from cache_shm.client import CacheClient
from cache_shm.names import sweep_stale
from cache_shm.shm import HDR, WKC, CacheShm
from gpu_worker.knobs import read_chunks as knob_read_chunks
from procs.restart_budget import RestartBudget
from procs.spawn import spawn_module


class Supervisor:
    def __init__(self, store, *, cache_bytes: int | None = None, n_slots: int | None = None,
                 n_workers: int = 4, policy: str = "reuse", verify_checksums: bool = True,
                 direct: str = "auto", prefetch_depth: int = 2, read_chunks: int | None = None,
                 worker_args: tuple = (), restart_budget=RestartBudget.from_env, log=None):
        """restart_budget() -> a fresh `RestartBudget`, one per kind of process (default: from the
        environment, see procs/restart_budget.py). read_chunks: concurrent preadv calls a block (default:
        `MOESTREAM_READ_CHUNKS`, else 4; gpu_worker/knobs.py)."""
        self.store = store
        self.shm_kw = dict(cache_bytes=cache_bytes, n_slots=n_slots, n_workers=n_workers,
                           verify_checksums=verify_checksums, direct=direct,
                           prefetch_depth=prefetch_depth)
        self.policy = policy
        self.read_chunks = read_chunks if read_chunks is not None else knob_read_chunks()
        self.worker_args = ("--read-chunks", str(self.read_chunks), *worker_args)   # later ones win
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.shm: CacheShm | None = None
        self.prefetcher: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = []
        self.restarts = {"prefetcher": 0, "workers": 0}
        self.budgets = {"prefetcher": restart_budget(), "workers": restart_budget()}
        self._restart_due: dict[tuple, float] = {}      # (what, w) -> when its backoff ends
        self.failed: str | None = None
        self.on_failure = None                          # callable(why), from the monitor thread
        self._stopping = threading.Event()
        self._lock = threading.RLock()
        self._monitor: threading.Thread | None = None
        self._prev_sigterm = None
        self._client: CacheClient | None = None

    # ---- start -----------------------------------------------------------------------------
    def start(self, ready_timeout: float = 30.0) -> "Supervisor":
        sweep_stale(self.log)
        self.shm = CacheShm.create(self.store, **self.shm_kw)
        atexit.register(self.stop)
        if threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self.prefetcher = self._spawn_prefetcher()
            self.workers = [self._spawn_worker(w) for w in range(self.shm.n_workers)]
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise
        self._monitor = threading.Thread(target=self._watch, name="cache-supervisor", daemon=True)
        self._monitor.start()
        return self

    def _spawn_prefetcher(self):
        return spawn_module("prefetcher", ["--prefix", self.shm.prefix, "--policy", self.policy,
                                           "--parent-pid", os.getpid()])

    def _spawn_worker(self, w: int):
        self.shm.worker_counters[w, WKC["ready"]] = 0
        return spawn_module("io_workers.reader", ["--prefix", self.shm.prefix, "--worker", w,
                                                  "--parent-pid", os.getpid(), *self.worker_args])

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            pf_ok = int(self.shm.hdr[HDR["prefetcher_pid"]]) == self.prefetcher.pid
            w_ok = all(int(self.shm.worker_counters[w, WKC["ready"]]) and
                       int(self.shm.worker_counters[w, WKC["pid"]]) == p.pid
                       for w, p in enumerate(self.workers))
            if pf_ok and w_ok:
                return
            for p in [self.prefetcher, *self.workers]:
                if p.poll() is not None:
                    raise RuntimeError(f"cache process {p.args[2]} exited with {p.returncode} at start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cache processes did not come up within {timeout:.0f} s")
            time.sleep(0.01)

    # ---- watch -----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopping.wait(0.05):
            with self._lock:
                if self._stopping.is_set() or self.failed:
                    return
                if self.prefetcher.poll() is not None:
                    self._restart("prefetcher", None)
                for w, p in enumerate(self.workers):
                    if p.poll() is not None:
                        self._restart("workers", w)

    # ---- restarts: the one place that decides whether a dead child comes back ---------------
    def _restart(self, what: str, w: int | None) -> None:
        """`what` ("prefetcher" or "workers", the key of `restarts`) died; `w`: the IO worker's index. Called on
        every watch tick while it is dead: the first call takes a restart from the budget (or gives up), the
        one after the backoff spawns it."""
        old = self.prefetcher if w is None else self.workers[w]
        name = "prefetcher" if w is None else f"io worker {w}"
        now = time.monotonic()
        due = self._restart_due.get((what, w))
        if due is None:
            budget = self.budgets[what]
            delay = budget.allow()
            if delay is None:
                self._give_up(f"the {name} died again (exit {old.returncode}) after {budget.recent()} restarts of "
                              f"the {what} within {budget.window_s:g} s (budget: {budget.describe()}); the expert "
                              f"cache cannot be kept alive")
                return
            due = self._restart_due[(what, w)] = now + delay
            self.log(f"cache supervisor: {name} (pid {old.pid}) exited with {old.returncode}; restarting"
                     + (f" in {delay:.2f} s" if delay >= 0.01 else ""))
        if now < due:
            return
        del self._restart_due[(what, w)]
        self.restarts[what] += 1
        if w is None:
            self.prefetcher = self._spawn_prefetcher()
        else:
            self.workers[w] = self._spawn_worker(w)

    def _give_up(self, why: str) -> None:
        self.failed = why
        self.log(f"cache supervisor: {why}")
        if self._client is not None:
            self._client.broken = why
        if self.on_failure is not None:
            self.on_failure(why)

    # ---- client and teardown ---------------------------------------------------------------
    def client(self) -> CacheClient:
        """The compute side's client in this process (other processes: CacheClient.attach(prefix))."""
        if self._client is None:
            self._client = CacheClient(self.shm)
            self._client.broken = self.failed
        return self._client

    @property
    def prefix(self) -> str:
        return self.shm.prefix

    def child_pids(self) -> list[int]:
        return [p.pid for p in [self.prefetcher, *self.workers] if p is not None]

    def stop(self, timeout: float = 3.0) -> None:
        """Terminate every child, then unlink every shared object. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout)
        with self._lock:
            procs = [p for p in [self.prefetcher, *self.workers] if p is not None]
            if self.shm is not None:
                try:
                    self.shm.hdr[HDR["stopping"]] = 1
                except (AttributeError, TypeError):
                    pass
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if self.shm is not None:
                self.shm.close()
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass
        if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None

    def _on_sigterm(self, signum, frame):
        prev = self._prev_sigterm
        self.stop()
        if callable(prev):
            prev(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
