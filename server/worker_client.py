"""The launcher's side of the compute process: starts `python -m gpu_worker.worker`, queues requests (batch 1,
first in first out, bounded), relays its messages (`procs.messages`) to the request that owns them, and restarts
it when it dies.

The worker runs in its own session (so a Ctrl-C at the terminal reaches only the launcher, which then drains
and stops it in order) and dies with the launcher (socket EOF, `procs.spawn.die_with_parent`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from procs import messages as m
from procs.restart_budget import RestartBudget
from procs.spawn import spawn_module


class QueueFull(Exception):
    pass


class WorkerUnavailable(Exception):
    pass


@dataclass
class WorkerConfig:
    store: str
    cache_bytes: int
    model: str | None = None
    io_workers: int = 4
    device: str = "cpu"
    dtype: str = "fp32"
    prefill_chunk: int = 0         # cap on the prefill span (0: the memory budget alone)
    threads: int = 0
    snapshot_dir: str | None = None
    snapshot_count: int = 32
    snapshot_ram_bytes: int = 2 << 30
    snapshot_disk_count: int = 64
    vram_bytes: int | None = None     # the device budget; what the dense part leaves becomes the VRAM tier
    prefill_reserve_bytes: int = 0    # kept beside the VRAM tier for prefills (0: the worker's automatic share)
    warm_cache: str = "auto"          # auto: a RAM cache that holds every expert is filled from the start
    cache_policy: str = "reuse"       # the RAM cache's eviction policy (prefetcher/policy.py)

    def args(self, fd: int) -> list[str]:
        """The command line of `python -m gpu_worker.worker`."""
        a = ["--fd", str(fd), "--store", self.store,
             "--cache-bytes", str(self.cache_bytes), "--io-workers", str(self.io_workers), "--device", self.device,
             "--dtype", self.dtype, "--prefill-chunk", str(self.prefill_chunk), "--threads", str(self.threads),
             "--snapshot-count", str(self.snapshot_count), "--snapshot-ram-bytes", str(self.snapshot_ram_bytes),
             "--snapshot-disk-count", str(self.snapshot_disk_count)]
        if self.model:
            a += ["--model", self.model]
        if self.snapshot_dir:
            a += ["--snapshot-dir", self.snapshot_dir]
        if self.vram_bytes:
            a += ["--vram-bytes", str(self.vram_bytes)]
        a += ["--warm-cache", self.warm_cache, "--cache-policy", self.cache_policy]
        if self.prefill_reserve_bytes:
            a += ["--prefill-reserve-bytes", str(self.prefill_reserve_bytes)]
        return a


@dataclass
class Job:
    id: str
    msg: m.Generate
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "queued"            # queued | running | finished
    cancelled: bool = False
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerClient:
    def __init__(self, cfg: WorkerConfig, max_queue: int = 64, log=None, max_start_failures: int = 5,
                 max_restarts: int = 20, restart_window_s: float = 300.0):
        self.cfg, self.max_queue = cfg, max_queue
        # deaths in a sliding window, not in the server's life: a process that crashed 20 times over weeks is fine
        self.restart_budget = RestartBudget(max_restarts, restart_window_s, backoff_s=0.0)
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.max_start_failures = max_start_failures
        self.state = "loading"           # loading | ready | restarting | stopping | stopped | failed
        self.status = "starting"
        self.info: m.WorkerInfo | None = None
        self.fatal: str | None = None
        self.restarts = 0
        self.proc: subprocess.Popen | None = None
        self.queue: deque[Job] = deque()
        self.running: Job | None = None
        self._ids = itertools.count()
        self._stats_seq = itertools.count()
        self._stats_waiters: dict[int, asyncio.Future[m.EngineStats]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._wake = asyncio.Event()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._failed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.on_status = None            # callable(str): loading progress for sd_notify

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the worker and wait until it is ready; raises RuntimeError with its message if it cannot load."""
        await self._spawn()
        self._tasks.append(asyncio.create_task(self._dispatch(), name="worker-dispatch"))
        waiter = asyncio.create_task(self._ready.wait())
        failed = asyncio.create_task(self._failed.wait())
        await asyncio.wait({waiter, failed}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel(), failed.cancel()
        if not self._ready.is_set():
            raise RuntimeError(self.fatal or "the compute process did not start")

    async def _spawn(self) -> None:
        parent, child = socket.socketpair()
        self.proc = spawn_module("gpu_worker.worker", self.cfg.args(child.fileno()), pass_fds=(child.fileno(),),
                                 new_session=True)
        child.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=parent)
        self._tasks.append(asyncio.create_task(self._read(reader, self.proc), name="worker-read"))

    def _send(self, msg) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(m.encode(msg))

    async def _read(self, reader: asyncio.StreamReader, proc: subprocess.Popen) -> None:
        unpacker = m.unpacker()
        while True:
            try:
                data = await reader.read(1 << 16)
            except (ConnectionError, OSError):
                data = b""
            if not data:
                break
            unpacker.feed(data)
            for obj in unpacker:
                self._on_wire(obj)
        await self._on_exit(proc)

    def _on_wire(self, obj) -> None:
        try:
            msg = m.decode(obj, m.TO_LAUNCHER)
        except m.ProtocolError as e:
            self._on_bad_message(obj, e)
            return
        self._on_message(msg)

    def _on_message(self, msg) -> None:
        if isinstance(msg, m.Status):
            self.status = msg.message
            if self.on_status:
                self.on_status(self.status)
        elif isinstance(msg, m.Ready):
            self.info = msg.info
            self.state = "ready"
            self.status = "ready"
            self._ready.set()
            self._wake.set()
        elif isinstance(msg, m.Fatal):
            self.fatal = msg.message
            if self.state == "ready":       # it can serve no more (its cache processes are lost): fail now
                self.log(f"launcher: {self.fatal}")
                job = self.running
                if job is not None:
                    job.events.put_nowait(m.Error(job.id, self.fatal))
                    self._finish(job)
                self._fail_all(self.fatal)
        elif isinstance(msg, m.StatsReply):
            fut = self._stats_waiters.pop(msg.seq, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, (m.Started, m.Token, m.Done, m.Error)):
            job = self.running
            if job is None or job.id != msg.id:
                return
            job.events.put_nowait(msg)
            if isinstance(msg, (m.Done, m.Error)):
                self._finish(job)

    def _on_bad_message(self, obj, e: m.ProtocolError) -> None:
        """A message this launcher cannot read (a bug, or a worker of another version): said clearly, and the
        request it was for fails instead of waiting for ever."""
        self.log(f"launcher: unreadable message from the compute process: {e}")
        job = self.running
        if job is not None and isinstance(obj, dict) and obj.get("id") == job.id:
            job.events.put_nowait(m.Error(job.id, f"the compute process sent an unreadable message: {e}"))
            self._finish(job)

    def _finish(self, job: Job) -> None:
        job.state = "finished"
        job.finished.set()
        if self.running is job:
            self.running = None
        self._update_idle()
        self._wake.set()

    def _update_idle(self) -> None:
        if self.running is None and not any(not j.cancelled for j in self.queue):
            self._idle.set()
        else:
            self._idle.clear()

    async def _on_exit(self, proc: subprocess.Popen) -> None:
        rc = await asyncio.get_running_loop().run_in_executor(None, _wait, proc, 10.0)
        self._writer = None
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_result(m.EngineStats())
        self._stats_waiters.clear()
        if self.state in ("stopping", "stopped"):
            return
        kill_group(proc, signal.SIGKILL)    # its cache processes, if any outlived it
        why = _exit_text(rc)
        job = self.running
        if job is not None:
            job.events.put_nowait(m.Error(job.id, f"the compute process crashed ({why}) while serving this request; "
                                                  f"it is being restarted", crash=True))
            self._finish(job)
        if self.restart_budget.allow() is None:
            b = self.restart_budget
            self.fatal = (f"the compute process died again ({why}) after {b.recent()} restarts within "
                          f"{b.window_s:g} s; not restarting it again")
        if self.state == "loading" or self.fatal:
            self.fatal = self.fatal or f"the compute process exited while loading ({why})"
            self.log(f"launcher: {self.fatal}")
            self._fail_all(self.fatal)
            return
        self.log(f"launcher: the compute process (pid {proc.pid}) died ({why}); restarting it")
        self.state = "restarting"
        self._ready.clear()
        for attempt in range(self.max_start_failures):
            if self.state != "restarting":
                return
            self.restarts += 1
            self.fatal = None
            try:
                await self._spawn()
            except OSError as e:
                self.log(f"launcher: restarting the compute process failed: {e}")
                await asyncio.sleep(min(2 ** attempt, 30))
                continue
            return      # its reader task takes over; a second death comes back here
        self._fail_all("the compute process could not be restarted")

    def _fail_all(self, why: str) -> None:
        self.state = "failed"
        self.fatal = self.fatal or why
        self._failed.set()
        while self.queue:
            j = self.queue.popleft()
            j.events.put_nowait(m.Error(j.id, why))
            self._finish(j)

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, msg: m.Generate) -> Job:
        """Queue a request; its id is given here (the one in `msg` is replaced)."""
        if self.state in ("stopping", "stopped", "failed"):
            raise WorkerUnavailable("the server is shutting down" if self.state != "failed" else self.fatal)
        waiting = sum(1 for j in self.queue if not j.cancelled)
        if waiting >= self.max_queue:
            raise QueueFull(f"{waiting} requests are waiting (--max-queue {self.max_queue})")
        rid = f"r{next(self._ids)}"
        job = Job(rid, dataclasses.replace(msg, id=rid))
        self.queue.append(job)
        self._idle.clear()
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """Give up on `job`: a queued one is dropped; a running one stops within one token."""
        if job.cancelled or job.state == "finished":
            return
        job.cancelled = True
        if job.state == "queued":
            try:
                self.queue.remove(job)
            except ValueError:
                pass
            self._finish(job)
        else:
            self._send(m.Cancel(job.id))

    @property
    def queue_depth(self) -> int:
        return sum(1 for j in self.queue if not j.cancelled)

    async def _dispatch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.state in ("stopped", "failed"):
                return
            if self.running is not None or self.state != "ready":
                continue
            while self.queue and self.queue[0].cancelled:
                self.queue.popleft()
            if not self.queue:
                self._update_idle()
                continue
            job = self.queue.popleft()
            job.state, job.started = "running", time.monotonic()
            self.running = job
            try:
                self._send(job.msg)
            except Exception as e:        # e.g. a value msgpack cannot carry: fail this request, not the queue
                job.events.put_nowait(m.Error(job.id, f"could not send the request: {e}"))
                self._finish(job)
            self._wake.set()

    async def stats(self, timeout: float = 2.0) -> m.EngineStats:
        """The engine's figures; empty ones when the compute process is not there to answer."""
        if self._writer is None or self.state != "ready":
            return m.EngineStats()
        seq = next(self._stats_seq)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[seq] = fut
        self._send(m.StatsRequest(seq))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._stats_waiters.pop(seq, None)
            return m.EngineStats()

    async def wait_idle(self, timeout: float) -> bool:
        self._update_idle()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def abort_all(self, why: str) -> None:
        while self.queue:
            j = self.queue.popleft()
            if not j.cancelled:
                j.events.put_nowait(m.Error(j.id, why, abort=True))
            self._finish(j)
        if self.running is not None:
            self.cancel(self.running)

    async def stop(self, timeout: float = 20.0) -> None:
        """Stop the worker in order (it stops the cache processes and unlinks the shared memory); escalate to
        SIGTERM and SIGKILL of its process group when it does not exit in time."""
        if self.state != "ready":
            timeout = min(timeout, 3.0)     # a loading worker reads no messages until it is ready
        self.state = "stopping"
        self.abort_all("the server is shutting down")
        proc = self.proc
        self._send(m.Shutdown())
        if self._writer is not None:
            try:
                await asyncio.wait_for(self._writer.drain(), 1.0)
            except Exception:
                pass
        if proc is not None:
            loop = asyncio.get_running_loop()
            rc = await loop.run_in_executor(None, _wait, proc, timeout)
            if rc is None:
                self.log(f"launcher: the compute process did not stop within {timeout:.0f} s; terminating it")
                kill_group(proc, signal.SIGTERM)
                if await loop.run_in_executor(None, _wait, proc, 1.0) is None:     # a stuck one: no more waiting
                    kill_group(proc, signal.SIGKILL)
                    await loop.run_in_executor(None, _wait, proc, 5.0)
        job = self.running
        if job is not None:     # the worker went without ending it: end its response now, not at uvicorn's timeout
            job.events.put_nowait(m.Error(job.id, "the server is shutting down", abort=True))
            self._finish(job)
        self.state = "stopped"
        self._wake.set()
        for t in self._tasks:
            t.cancel()
        from cache_shm.names import sweep_stale
        sweep_stale(self.log)

    def kill_now(self) -> None:
        """The second signal: no drain, no order. Kill the worker's whole process group, sweep shared memory."""
        self.state = "stopped"
        proc = self.proc
        if proc is not None and proc.poll() is None:
            kill_group(proc, signal.SIGKILL)
            _wait(proc, 5.0)
        from cache_shm.names import sweep_stale
        sweep_stale(self.log)


def kill_group(proc: subprocess.Popen, sig) -> None:
    try:
        os.killpg(proc.pid, sig)      # its own session: the group holds the worker and its cache processes
    except (ProcessLookupError, PermissionError):
        pass


def _wait(proc: subprocess.Popen, timeout: float):
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _exit_text(rc) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"
