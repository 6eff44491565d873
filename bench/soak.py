"""A bounded soak of the whole server on the CPU: N concurrent clients on loopback, a mix of requests (plain,
streamed, cancelled after a few tokens, abandoned by a client timeout, tokenize, bad text, oversized bodies)
while a kill -9 hits each kind of process in turn (IO worker, prefetcher, compute process), for a fixed time.
Then SIGTERM, and a count of what is left.

    python -m bench.soak [--seconds 100] [--clients 4] [--fault-every 12] [--model DIR] [--out bench/results/...]

Reports requests completed, errors by status and code, /health latency, recovery after each kill, leaked
processes and /dev/shm objects (both must be 0), and RSS growth per process kind. A table on stdout and JSON
under bench/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("launcher", "compute", "prefetcher", "io_worker")
FAULT_ORDER = ("io_worker", "prefetcher", "compute")
WARMUP_S = 5.0


def kind_of(p: psutil.Process) -> str | None:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return None
    if "launcher.py" in cmd:
        return "launcher"
    if "gpu_worker" in cmd:
        return "compute"
    if "prefetcher" in cmd:
        return "prefetcher"
    if "io_workers" in cmd:
        return "io_worker"
    return None


class Server:
    def __init__(self, model: Path, port: int, workdir: Path, extra=()):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "launcher.log"
        self.snap_dir = workdir / "snaps"
        argv = [sys.executable, "launcher.py", "--model", str(model), "--port", str(port), "--threads", "1",
                "--io-workers", "2", "--cache-gb", "0.0005", "--max-model-len", "512", "--max-body-mb", "1",
                "--max-queue", "64", "--snapshot-dir", str(self.snap_dir), "--shutdown-timeout", "10",
                "--log-level", "warning", *extra]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.seen: dict[int, str] = {self.proc.pid: "launcher"}      # every pid of the server, ever

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("not ready")

    def processes(self) -> dict[str, list[psutil.Process]]:
        out = defaultdict(list)
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return out
        for p in procs:
            k = kind_of(p)
            if k:
                out[k].append(p)
                self.seen.setdefault(p.pid, k)
        return out


# ------------------------------------------------------------------------------------------------ clients
ACTIONS = [("complete", 3), ("stream", 3), ("cancel", 2), ("abandon", 1), ("tokenize", 1), ("bad_text", 1),
           ("big_body", 1)]


class Client(threading.Thread):
    def __init__(self, i: int, url: str, model: str, stop: threading.Event, results: list, lock):
        super().__init__(daemon=True, name=f"client-{i}")
        self.rng = random.Random(i)
        self.url, self.model, self.stop_ev, self.results, self.lock = url, model, stop, results, lock

    def record(self, action: str, status, code=None, tokens: int = 0, seconds: float = 0.0):
        with self.lock:
            self.results.append({"action": action, "status": status, "code": code, "tokens": tokens,
                                 "seconds": seconds, "t": time.monotonic()})

    def run(self):
        names, weights = zip(*ACTIONS)
        with httpx.Client(timeout=60) as http:
            while not self.stop_ev.is_set():
                action = self.rng.choices(names, weights)[0]
                t0 = time.monotonic()
                try:
                    getattr(self, action)(http, t0)
                except httpx.TimeoutException:
                    self.record(action, "client_timeout", seconds=time.monotonic() - t0)
                except httpx.TransportError as e:
                    self.record(action, "transport_error", type(e).__name__, seconds=time.monotonic() - t0)

    def _prompt(self):
        words = "the quick brown fox jumps over a lazy dog while experts stream from the disk".split()
        return " ".join(self.rng.choice(words) for _ in range(self.rng.randint(3, 40)))

    def _json_result(self, action, r, t0, tokens_key=True):
        code = None
        tokens = 0
        try:
            body = r.json()
            code = (body.get("error") or {}).get("code") if r.status_code >= 400 else None
            tokens = (body.get("usage") or {}).get("completion_tokens", 0)
        except ValueError:
            pass
        self.record(action, r.status_code, code, tokens, time.monotonic() - t0)

    def complete(self, http, t0):
        r = http.post(self.url + "/v1/completions", json={"model": self.model, "prompt": self._prompt(),
                                                          "max_tokens": self.rng.randint(4, 24), "ignore_eos": True,
                                                          "temperature": 0.8})
        self._json_result("complete", r, t0)

    def _stream(self, http, t0, action, path, body, stop_after=None):
        tokens, status, code = 0, None, None
        with http.stream("POST", self.url + path, json=body) as r:
            status = r.status_code
            if status != 200:
                r.read()
                try:
                    code = r.json()["error"].get("code")
                except (ValueError, KeyError):
                    pass
            else:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        status, code = f"sse_{ev['error'].get('type')}", ev["error"].get("code")
                        break
                    if ev.get("choices"):
                        tokens += 1
                        if stop_after is not None and tokens >= stop_after:
                            status = "cancelled_by_client"
                            break
        self.record(action, status, code, tokens, time.monotonic() - t0)

    def stream(self, http, t0):
        self._stream(http, t0, "stream", "/v1/chat/completions",
                     {"model": self.model, "messages": [{"role": "user", "content": self._prompt()}], "stream": True,
                      "max_tokens": self.rng.randint(8, 32), "ignore_eos": True,
                      "chat_template_kwargs": {"enable_thinking": False}})

    def cancel(self, http, t0):
        self._stream(http, t0, "cancel", "/v1/completions",
                     {"model": self.model, "prompt": self._prompt(), "stream": True, "max_tokens": 200,
                      "ignore_eos": True}, stop_after=self.rng.randint(1, 5))

    def abandon(self, http, t0):
        try:
            r = http.post(self.url + "/v1/completions", json={"model": self.model, "prompt": self._prompt(),
                                                              "max_tokens": 100, "ignore_eos": True}, timeout=0.3)
            self._json_result("abandon", r, t0)
        except httpx.TimeoutException:
            self.record("abandon", "abandoned_by_client", seconds=time.monotonic() - t0)

    def tokenize(self, http, t0):
        self._json_result("tokenize", http.post(self.url + "/tokenize", json={"model": self.model,
                                                                              "prompt": self._prompt()}), t0)

    def bad_text(self, http, t0):
        body = json.dumps({"model": self.model, "prompt": "a\ud800b", "max_tokens": 1})
        self._json_result("bad_text", http.post(self.url + "/v1/completions", content=body,
                                                headers={"content-type": "application/json"}), t0)

    def big_body(self, http, t0):
        body = json.dumps({"model": self.model, "prompt": "x" * (2 << 20), "max_tokens": 1})
        self._json_result("big_body", http.post(self.url + "/v1/completions", content=body,
                                                headers={"content-type": "application/json"}), t0)


# ------------------------------------------------------------------------------------------------ the run
def rss_mb(p: psutil.Process) -> float | None:
    try:
        return p.memory_info().rss / 2**20
    except psutil.Error:
        return None


def health_ms(url: str) -> tuple[int | None, float]:
    t0 = time.monotonic()
    try:
        code = httpx.get(url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        code = None
    return code, (time.monotonic() - t0) * 1e3


def soak(model: Path, seconds: float, n_clients: int, fault_every: float, port: int, workdir: Path) -> dict:
    srv = Server(model, port, workdir)
    startup_s = srv.wait_ready(300)
    model_id = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    rss = defaultdict(dict)         # pid -> {"kind", "first", "last"}

    def sample():
        for k, procs in srv.processes().items():
            for p in procs:
                m = rss_mb(p)
                if m is not None:
                    e = rss.setdefault(p.pid, {"kind": k, "first": m, "first_t": time.monotonic()})
                    e["last"], e["last_t"] = m, time.monotonic()

    stop, lock, results = threading.Event(), threading.Lock(), []
    clients = [Client(i, srv.url, model_id, stop, results, lock) for i in range(n_clients)]
    for c in clients:
        c.start()
    t_start = time.monotonic()
    time.sleep(WARMUP_S)        # the baseline RSS is taken under load, once the first requests have run
    sample()
    baseline = set(rss)
    faults, health = [], []
    next_fault, k = t_start + fault_every / 2, 0
    while time.monotonic() - t_start < seconds:
        if srv.proc.poll() is not None:
            break
        code, ms = health_ms(srv.url)
        health.append({"t": time.monotonic() - t_start, "status": code, "ms": ms})
        sample()
        if time.monotonic() >= next_fault:
            kind = FAULT_ORDER[k % len(FAULT_ORDER)]
            procs = srv.processes().get(kind, [])
            if procs:
                victim = procs[0]
                os.kill(victim.pid, signal.SIGKILL)
                faults.append({"t": time.monotonic() - t_start, "kind": kind, "pid": victim.pid})
            k += 1
            next_fault += fault_every
        time.sleep(0.5)
    stop.set()
    for c in clients:
        c.join(90)
    sample()
    # recovery: the first healthy answer after each kill
    for f in faults:
        after = [h for h in health if h["t"] > f["t"] and h["status"] == 200]
        f["healthy_again_s"] = round(after[0]["t"] - f["t"], 2) if after else None
    # ---- stop: SIGTERM, then count what is left
    pids_seen = dict(srv.seen)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        rc = srv.proc.wait(60)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        rc = "killed after 60 s"
    stop_s = time.monotonic() - t0
    time.sleep(1.0)
    leaked = [{"pid": pid, "kind": kind} for pid, kind in pids_seen.items() if _alive(pid)]
    sys.path.insert(0, str(ROOT))
    from cache_shm.names import list_entries, owner_pid_of
    shm_left = [e for e in list_entries() if owner_pid_of(e) in pids_seen]
    tmp_left = [p.name for p in srv.snap_dir.glob("*.tmp*")] if srv.snap_dir.exists() else []
    for pid in [p["pid"] for p in leaked]:          # leave the machine clean even when the run failed
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    by_action = defaultdict(Counter)
    for r in results:
        by_action[r["action"]][str(r["status"]) + (f" {r['code']}" if r["code"] else "")] += 1
    growth = defaultdict(list)
    for pid, e in rss.items():        # growth only for processes there from the baseline (restarts load anew)
        growth[e["kind"]].append({"pid": pid, "first_mb": round(e["first"], 1), "last_mb": round(e["last"], 1),
                                  "growth_mb": round(e["last"] - e["first"], 1) if pid in baseline else None,
                                  "lived_s": round(e["last_t"] - e["first_t"], 1), "from_baseline": pid in baseline})
    hs = [h["ms"] for h in health if h["status"] is not None]
    return {
        "seconds": seconds, "clients": n_clients, "fault_every_s": fault_every, "startup_s": round(startup_s, 1),
        "requests": len(results), "tokens": sum(r["tokens"] for r in results),
        "outcomes": {a: dict(c) for a, c in sorted(by_action.items())},
        "faults": faults,
        "health": {"checks": len(health), "non_200": sum(1 for h in health if h["status"] != 200),
                   "max_ms": round(max(hs), 1) if hs else None,
                   "p50_ms": round(sorted(hs)[len(hs) // 2], 1) if hs else None},
        "stop": {"exit_code": rc, "seconds": round(stop_s, 2)},
        "leaked_processes": leaked, "leaked_shm": shm_left, "leaked_snapshot_tmp": tmp_left,
        "rss": {k: sorted(v, key=lambda g: -g["lived_s"]) for k, v in growth.items()},
        "processes_seen": Counter(pids_seen.values()),
        "log_tail": srv.log_path.read_text(errors="replace")[-1500:],
    }


def _alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def print_table(r: dict) -> None:
    print(f"\nsoak: {r['seconds']:.0f} s, {r['clients']} clients, a kill -9 every {r['fault_every_s']:g} s "
          f"(start-up {r['startup_s']} s)")
    print(f"requests {r['requests']}, tokens streamed/generated {r['tokens']}")
    print(f"{'action':<10} outcomes")
    for a, c in r["outcomes"].items():
        print(f"{a:<10} " + ", ".join(f"{k}: {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])))
    print("faults: " + "; ".join(f"{f['kind']} at {f['t']:.0f} s (healthy {f['healthy_again_s']} s later)"
                                 for f in r["faults"]))
    h = r["health"]
    print(f"/health: {h['checks']} checks, {h['non_200']} not 200, p50 {h['p50_ms']} ms, max {h['max_ms']} ms")
    print(f"SIGTERM: exit {r['stop']['exit_code']} after {r['stop']['seconds']} s")
    print(f"leaked processes: {len(r['leaked_processes'])}, /dev/shm objects: {len(r['leaked_shm'])}, "
          f"snapshot temporaries: {len(r['leaked_snapshot_tmp'])}")
    print(f"{'kind':<11} {'pids':>4}  RSS growth of the processes alive from the baseline to their end")
    for k in KINDS:
        g = [x for x in r["rss"].get(k, []) if x["from_baseline"]]
        if g:
            print(f"{k:<11} {len(r['rss'][k]):>4}  " + ", ".join(
                f"{x['first_mb']:.0f} → {x['last_mb']:.0f} MB ({x['growth_mb']:+.1f}) over {x['lived_s']:.0f} s"
                for x in g))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: a tiny synthetic one written to a temporary directory)")
    ap.add_argument("--seconds", type=float, default=100.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fault-every", type=float, default=12.0)
    ap.add_argument("--port", type=int, default=18765)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak_cpu.json"))
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moestream-soak-") as tmp:
        tmp = Path(tmp)
        model = Path(a.model) if a.model else tmp / "tiny"
        if not a.model:
            subprocess.run([sys.executable, "-m", "tools.synth", "--preset", "tiny", "--quant", "nvfp4", "--seed", "0",
                            "--out", str(model)], cwd=ROOT, check=True, capture_output=True)
        r = soak(model, a.seconds, a.clients, a.fault_every, a.port, tmp)
    print_table(r)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(r, indent=1, default=str) + "\n")
    print(f"wrote {a.out}")
    clean = not r["leaked_processes"] and not r["leaked_shm"] and not r["leaked_snapshot_tmp"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
