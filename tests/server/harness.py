"""Starts the real launcher (`python launcher.py`) on a free localhost port with a tiny synthetic model, and
looks at what it leaves behind (child processes, /dev/shm)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]


# The launcher binds port 0 itself and names the port it got: a port picked here and closed before the launcher
# binds it could be taken in between.
LISTENING = re.compile(rb"listening on (http://[^\s]+) ")


@contextlib.contextmanager
def refusing_port():
    """A localhost port that refuses connections while the block runs: bound, so nobody else takes it, and never
    listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


class Launcher:
    def __init__(self, model: Path, *args: str, env: dict | None = None, api_key: str | None = None):
        self.url: str | None = None         # known once the launcher says where it listens
        self.api_key = api_key
        self.argv = [sys.executable, "launcher.py", *(["--model", str(model)] if model else []), "--port", "0",
                     "--threads", "1", "--io-workers", "2", "--log-level", "warning", *args]
        self.env = dict(os.environ, **(env or {}))
        if api_key:
            self.env["MOESTREAM_API_KEY"] = api_key
        self.proc: subprocess.Popen | None = None
        self.health_seen: list[int] = []
        self.health_messages: list[str] = []    # what /health said while not ready, each change once
        self.log_path: Path | None = None

    def start(self, log_path: Path, timeout: float = 240.0) -> "Launcher":
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {self.proc.returncode}:\n{self.log()}")
            if self.url is None:
                found = LISTENING.search(log_path.read_bytes())
                if found is None:
                    time.sleep(0.05)
                    continue
                self.url = found.group(1).decode()
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                code = r.status_code
                if not self.health_seen or self.health_seen[-1] != code:
                    self.health_seen.append(code)
                if code == 503:
                    said = r.json()["error"]["message"]
                    if not self.health_messages or self.health_messages[-1] != said:
                        self.health_messages.append(said)
                if code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop(signal.SIGKILL)
        raise TimeoutError(f"launcher not ready within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def worker(self) -> psutil.Process:
        for p in self.descendants():
            try:
                if "gpu_worker.worker" in " ".join(p.cmdline()):
                    return p
            except psutil.NoSuchProcess:
                pass
        raise LookupError("no compute process")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def openai(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)


def shm_entries_of(pids) -> list[str]:
    from cache_shm.names import list_entries, owner_pid_of
    pids = set(pids)
    return [e for e in list_entries() if owner_pid_of(e) in pids]


def alive(procs) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
