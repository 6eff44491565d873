"""moestream as its users run it: `launcher.py` serving the OpenAI API, measured from the client side and
from the server's own per-request timings and /metrics counters."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    return 0.0


@dataclass
class RequestFigures:
    prompt_tokens: int
    ttft_client_s: float           # first SSE token as the user sees it
    prefill_ms: float              # the server's prompt_ms
    decode_ms_per_token: float
    lookups: float                 # expert look-ups during the request, and how many hit
    hits: float
    bytes_from_disk: float         # the whole request; the prefill's share below
    prefill_bytes_from_disk: float
    bytes_over_pcie: float
    prefill_bytes_over_pcie: float
    decode_steps: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else float("nan")

    @property
    def decode_disk_bytes_per_token(self) -> float:
        steps = self.decode_steps
        return (self.bytes_from_disk - self.prefill_bytes_from_disk) / steps if steps else float("nan")

    @property
    def decode_pcie_bytes_per_token(self) -> float:
        steps = self.decode_steps
        return (self.bytes_over_pcie - self.prefill_bytes_over_pcie) / steps if steps else float("nan")


_TOO_SMALL = re.compile(r"raise --vram-gb to at least ([\d.]+)")


def vram_floor_from_log(text: str) -> float | None:
    """The --vram-gb the compute process asked for when it refused a budget with no room for a VRAM tier."""
    m = _TOO_SMALL.findall(text)
    return float(m[-1]) if m else None


class MoestreamServer:
    def __init__(self, model: Path, store: Path, *, cache_gb: float, device: str, vram_gb: float | None,
                 io_workers: int = 8, log_path: Path | None = None, extra: list[str] | None = None,
                 cpus: list[int] | None = None, pid_dir: Path | None = None, port: int = 0,
                 checkout: Path = ROOT):
        """port 0: a free one; checkout: whose launcher.py runs (an A/B of two checkouts on one machine)."""
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, str(Path(checkout) / "launcher.py"), "--model", str(model), "--store", str(store),
                "--cache-gb", str(cache_gb), "--device", device, "--io-workers", str(io_workers),
                "--port", str(self.port), "--log-level", "warning", *(extra or [])]
        if vram_gb is not None:
            argv += ["--vram-gb", str(vram_gb)]
        self.log_path = log_path
        self._log = open(log_path or os.devnull, "ab")
        pin = (lambda: os.sched_setaffinity(0, set(cpus))) if cpus else None       # its children inherit it
        self.proc = subprocess.Popen(argv, cwd=checkout, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=pin)
        # its own session outlives a harness that is killed: the pid file lets the caller's shell end it
        self.pid_file = Path(pid_dir) / str(self.proc.pid) if pid_dir else None
        if self.pid_file:
            self.pid_file.parent.mkdir(parents=True, exist_ok=True)
            self.pid_file.write_text(" ".join(argv))
        self.http = httpx.Client(base_url=self.url, timeout=600)

    def wait_ready(self, timeout: float = 600) -> None:
        t_end = time.time() + timeout
        while time.time() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher.py exited with {self.proc.returncode} before it was ready")
            try:
                if self.http.get("/health").status_code == 200:
                    self.model_id = self.http.get("/v1/models").json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("launcher.py did not become ready")

    def memory_bytes(self) -> dict[str, int]:
        """What the server's processes hold in RAM: unique set sizes of every process, and the shared memory
        (the slab, its index and rings) in /dev/shm."""
        import psutil
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        uss = sum(p.memory_full_info().uss for p in procs if p.is_running())
        shm = sum(f.stat().st_size for f in Path("/dev/shm").glob("moestream-*") if f.is_file())
        return {"uss_bytes": uss, "shm_bytes": shm, "total_bytes": uss + shm, "processes": len(procs)}

    def complete(self, prompt: str, max_tokens: int) -> RequestFigures:
        m0 = self.http.get("/metrics").text
        body = {"model": self.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "cache_prompt": False, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft, timings, usage = None, {}, {}
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.read()[:500]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ttft is None and ev.get("choices") and ev["choices"][0].get("text"):
                    ttft = time.perf_counter() - t0
                timings = ev.get("timings") or timings
                usage = ev.get("usage") or usage
        m1 = self.http.get("/metrics").text
        d = {k: _metric(m1, "moestream_" + k) - _metric(m0, "moestream_" + k)
             for k in ("expert_cache_hits", "expert_cache_misses", "bytes_from_disk", "prefill_bytes_from_disk",
                       "bytes_over_pcie", "prefill_bytes_over_pcie")}
        steps = timings.get("decode_steps") or 0
        return RequestFigures(
            prompt_tokens=int(usage.get("prompt_tokens", 0)), ttft_client_s=ttft or float("nan"),
            prefill_ms=float(timings.get("prompt_ms", float("nan"))),
            decode_ms_per_token=float(timings.get("predicted_ms", 0.0)) / steps if steps else float("nan"),
            lookups=d["expert_cache_hits"] + d["expert_cache_misses"], hits=d["expert_cache_hits"],
            bytes_from_disk=d["bytes_from_disk"], prefill_bytes_from_disk=d["prefill_bytes_from_disk"],
            bytes_over_pcie=d["bytes_over_pcie"], prefill_bytes_over_pcie=d["prefill_bytes_over_pcie"],
            decode_steps=int(steps))

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        if self.pid_file:
            self.pid_file.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
