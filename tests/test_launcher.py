"""The launcher as a process (tiny synthetic model, CPU): readiness over sd_notify, the bounded queue, a crashed
compute process, the SIGTERM drain and its clean-up, snapshots that survive a restart, the second signal."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server.harness import ROOT, Launcher, alive, shm_entries_of

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def notifications(sock) -> list[str]:
    out = []
    while True:
        try:
            out += sock.recv(4096).decode().split("\n")
        except (BlockingIOError, socket.timeout):
            return out


class Stream(threading.Thread):
    """A streamed completion read in the background: `first` is set at the first token chunk, `events` holds
    every parsed data line, `stop_early` makes it hang up after the first token."""

    def __init__(self, server, max_tokens, stop_early=False, **body):
        super().__init__(daemon=True)
        self.server, self.stop_early = server, stop_early
        self.body = {"model": "m", "prompt": "The fox", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}, **body}
        self.first, self.events, self.status, self.error = threading.Event(), [], None, None
        self.start()

    def run(self):
        self.body["model"] = httpx.get(self.server.url + "/v1/models").json()["data"][0]["id"]
        try:
            with httpx.stream("POST", self.server.url + "/v1/completions", json=self.body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.events.append(line[6:])
                    if line[6:] != "[DONE]" and json.loads(line[6:]).get("choices"):
                        self.first.set()
                        if self.stop_early:
                            return
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.first.set()

    def usage(self) -> dict:
        return json.loads(self.events[-2])["usage"]

    def finish_reason(self) -> str:
        return [json.loads(e)["choices"][0]["finish_reason"] for e in self.events[:-1]
                if json.loads(e).get("choices")][-1]


def model_id(s):
    return httpx.get(s.url + "/v1/models").json()["data"][0]["id"]


def complete(s, **kw):
    return httpx.post(s.url + "/v1/completions", json={"model": model_id(s), "prompt": "hi", "max_tokens": 2,
                                                      "ignore_eos": True, **kw}, timeout=120)


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def waiting(s) -> float:
    for line in httpx.get(s.url + "/metrics").text.splitlines():
        if line.startswith("moestream_requests_waiting "):
            return float(line.split()[1])
    raise KeyError


def test_lifecycle(synth, tmp_path):
    model = synth("tiny", "nvfp4")
    snaps = tmp_path / "snaps"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    args = ("--max-queue", "1", "--snapshot-dir", str(snaps), "--shutdown-timeout", "30")
    s = Launcher(model, *args, env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    try:
        s.start(tmp_path / "run1.log")
        # ---- systemd readiness: extended start timeout while loading, then READY=1
        msgs = notifications(sock)
        assert "READY=1" in msgs, msgs
        ext = [i for i, m in enumerate(msgs) if m.startswith("EXTEND_TIMEOUT_USEC=")]
        assert ext and ext[0] < msgs.index("READY=1") and any(m.startswith("STATUS=") for m in msgs)

        # ---- the bounded queue: one computing, one waiting, the next one 503 + Retry-After
        a = Stream(s, 3000)        # long enough to still be running on a fast machine; cancelled below
        assert a.first.wait(60)
        b_result = {}
        b = threading.Thread(target=lambda: b_result.setdefault("r", complete(s)))
        b.start()
        wait_for(lambda: waiting(s) == 1, 30, "the second request to queue")
        r = complete(s)
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        assert r.json()["error"]["code"] == "queue_full"
        a.stop_early = True           # hang up: the computing request is cancelled, the queued one runs
        b.join(60)
        assert b_result["r"].status_code == 200
        assert complete(s).status_code == 200          # the twin: with the queue empty, accepted

        # ---- a crashed compute process: the in-flight request fails clearly, the process is restarted
        old = s.worker()
        old_family = [old] + old.children(recursive=True)
        d = Stream(s, 3000)
        assert d.first.wait(60)
        old.kill()
        d.join(60)
        assert d.events[-1] == "[DONE]" and "crashed" in json.loads(d.events[-2])["error"]["message"]
        wait_for(lambda: httpx.get(s.url + "/health").status_code == 200 and s.worker().pid != old.pid, 90,
                 "the compute process to come back")
        assert complete(s).status_code == 200
        wait_for(lambda: not alive(old_family), 10, "the dead worker's cache processes to go")
        assert shm_entries_of([p.pid for p in old_family]) == []

        # ---- a chat turn, kept on disk
        turn1 = [{"role": "user", "content": "Name a colour."}]
        r1 = httpx.post(s.url + "/v1/chat/completions", json={"model": model_id(s), "messages": turn1,
                                                                "max_tokens": 5, "temperature": 0, **NO_THINK},
                        timeout=120).json()
        wait_for(lambda: len(list(snaps.glob("*.snap"))) >= 2, 30, "snapshots on disk")

        # ---- SIGTERM: the in-flight request finishes, new ones are refused, everything stops and is unlinked
        family = [p for p in s.descendants()]
        pids = [s.proc.pid] + [p.pid for p in family]
        e = Stream(s, 40)
        assert e.first.wait(60)
        s.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining" in s.log(), 10, "the launcher to start draining")
        try:
            assert complete(s).status_code == 503
        except httpx.TransportError:
            pass
        assert s.proc.wait(60) == 0, s.log()
        e.join(10)
        assert e.usage()["completion_tokens"] == 40 and e.finish_reason() == "length", e.events[-3:]
        assert "STOPPING=1" in notifications(sock)
        assert alive(family) == [], [p.cmdline() for p in alive(family)]
        assert shm_entries_of(pids) == []

        # ---- restart: the conversation continues from the snapshot on disk
        s2 = Launcher(model, *args)
        s2.start(tmp_path / "run2.log")
        s = s2
        turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "Another."}]
        r2 = httpx.post(s.url + "/v1/chat/completions", json={"model": model_id(s), "messages": turn2,
                                                                "max_tokens": 3, "temperature": 0, **NO_THINK},
                        timeout=120).json()
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert "moestream_snapshot_hits_disk_total 1.0" in httpx.get(s.url + "/metrics").text

        # ---- a second signal exits at once, and still leaves nothing behind
        family = s.descendants()
        pids = [s.proc.pid] + [p.pid for p in family]
        f = Stream(s, 120)
        assert f.first.wait(60)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining" in s.log(), 10, "the first signal to be handled")
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(30)
        assert time.monotonic() - t0 < 5 and rc == 128 + signal.SIGTERM
        wait_for(lambda: not alive(family), 10, "children to go")
        assert shm_entries_of(pids) == []
    finally:
        s.stop(signal.SIGKILL)
        sock.close()


def test_preflight_says_what_to_change(monkeypatch):
    import argparse

    import launcher
    a = argparse.Namespace(cache_gb=100000.0, device="cpu", vram_gb=None, snapshot_ram_gb=2.0)
    problems = launcher.preflight(a, 100000 * launcher.GiB, 1 << 20, 0)
    assert any("/dev/shm" in p and "lower --cache-gb" in p for p in problems), problems
    assert any(p.startswith("RAM") and "lower --cache-gb" in p for p in problems), problems
    a.cache_gb = 0.01
    assert launcher.preflight(a, 10 << 20, 1 << 20, 0) == []           # the twin: a cache that fits
    monkeypatch.setattr(launcher, "free_vram", lambda device: 4 * launcher.GiB)
    a.device, a.vram_gb = "cuda", 8.0
    problems = launcher.preflight(a, 10 << 20, 6 * launcher.GiB, 0)
    assert any("--vram-gb 8" in p for p in problems) and any("dense part" in p for p in problems)
    a.vram_gb = 3.0
    assert launcher.preflight(a, 10 << 20, 1 * launcher.GiB, 0) == []
    a.prefill_gb = 0.0
    assert any(p.startswith("--prefill-gb 0") for p in launcher.preflight(a, 10 << 20, 1 * launcher.GiB, 0))
    a.prefill_gb = 1.5
    assert launcher.preflight(a, 10 << 20, 1 * launcher.GiB, 0) == []


def test_no_model_serves_the_demo_and_says_its_weights_are_random(tmp_path, monkeypatch):
    import launcher
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert launcher.demo_model_dir() == tmp_path / "moestream" / "demo-tiny-nvfp4"
    a = launcher.parse_args([])
    assert a.model is None and a.store is None and a.host == "127.0.0.1"


def test_readme_main_command_serves_the_demo_to_the_openai_client(tmp_path):
    """`python launcher.py` on a fresh machine: writes the demo model once, says its weights are random, and
    streams a chat answer to the official client (thinking off by default for the demo, so text is content)."""
    s = Launcher(None, env={"XDG_CACHE_HOME": str(tmp_path)})
    try:
        s.start(tmp_path / "demo.log")
        assert "RANDOM" in s.log() and (tmp_path / "moestream" / "demo-tiny-nvfp4" / "config.json").exists()
        c = s.openai()
        model = c.models.list().data[0].id
        chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                                stream=True, max_tokens=12, extra_body={"ignore_eos": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finally:
        assert s.stop() == 0


def verify_unit(text: str, tmp_path) -> str:
    import subprocess
    import sys
    unit = tmp_path / "moestream.service"
    unit.write_text(text.replace("/opt/moestream/.venv/bin/python", sys.executable)
                    .replace("/opt/moestream/launcher.py", str(ROOT / "launcher.py")))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    return (r.stdout + r.stderr).strip()


def test_systemd_unit_verifies(tmp_path):
    import shutil
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    text = (ROOT / "deploy" / "moestream.service").read_text()
    for key in ("Type=notify", "KillMode=mixed", "LimitMEMLOCK=infinity", "RemoveIPC=yes", "User=moestream"):
        assert f"\n{key}\n" in text
    assert "PrivateDevices=yes" not in text and "MemoryDenyWriteExecute=yes" not in text    # they break CUDA
    assert verify_unit(text, tmp_path) == ""
    assert "Unknown key" in verify_unit(text.replace("KillMode=mixed", "KillMood=mixed"), tmp_path)  # the twin


def test_preflight_shm_message_in_mib_below_a_gib_and_says_a_margin_is_included(monkeypatch):
    """A small cache in a small /dev/shm: the message gives MiB ("needs 0.00 GiB ... has 0.00 GiB free" said
    nothing) and says that what it needs includes a margin beside the cache."""
    import argparse
    import collections
    import shutil

    import launcher
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(64 << 20, 0, 40 << 20))
    a = argparse.Namespace(cache_gb=0.0039, device="cpu", vram_gb=None, snapshot_ram_gb=0.0)
    problems = [p for p in launcher.preflight(a, 4 << 20, 1 << 20, 0) if "/dev/shm" in p]
    assert len(problems) == 1, problems
    p = problems[0]
    assert "0.00 GiB" not in p and "68.0 MiB" in p and "40.0 MiB free" in p and "margin" in p, p
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(64 << 30, 0, 40 << 30))
    a.cache_gb = 100.0
    p = [p for p in launcher.preflight(a, 100 << 30, 1 << 20, 0) if "/dev/shm" in p][0]
    assert "100.06 GiB" in p and "40.00 GiB free" in p, p       # the twin: GiB from 1 GiB up


def test_sigterm_drain_honours_shutdown_timeout(synth, tmp_path):
    """A compute process that does not answer the cancel (stopped here; in life a long prefill chunk or a stuck
    read): the launcher still exits within --shutdown-timeout plus a short grace, killing it and its cache
    processes and leaving no shared memory. (It waited 20 s more, then 5 s after SIGTERM, before.)"""
    import os
    timeout_s = 2.0
    s = Launcher(synth("tiny", "nvfp4"), "--shutdown-timeout", str(timeout_s))
    try:
        s.start(tmp_path / "drain.log")
        a = Stream(s, 3000)
        assert a.first.wait(60)
        worker = s.worker()
        family = s.descendants()
        pids = [s.proc.pid] + [p.pid for p in family]
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(60)
        took = time.monotonic() - t0
        assert rc == 0 and took < timeout_s + 4.0, (rc, took, s.log()[-2000:])
        wait_for(lambda: not alive(family), 10, "children to go")
        assert shm_entries_of(pids) == []
        a.join(10)
        assert a.events and a.events[-1] == "[DONE]", a.events[-3:]
    finally:
        s.stop(signal.SIGKILL)


def test_cache_processes_that_cannot_be_kept_alive_end_the_launcher_non_zero(synth, tmp_path):
    """21 kills of an IO worker within the window (the default budget: 20 restarts in 300 s): /health turns 503
    with the reason, a request fails at once with it, and the launcher exits non-zero (systemd restarts it).
    Before, the supervisor stopped restarting silently: /health stayed 200 and requests hung 60 s."""
    import os

    def io_workers():
        out = []
        for p in s.descendants():
            try:
                if "io_workers.reader" in " ".join(p.cmdline()) and p.status() != "zombie":
                    out.append(p)
            except Exception:
                pass
        return out

    s = Launcher(synth("tiny", "nvfp4"), env={"MOESTREAM_CACHE_BACKOFF": "0.01/0.02"})   # the backoff only
    try:
        s.start(tmp_path / "budget.log")
        pids = [s.proc.pid] + [p.pid for p in s.descendants()]
        for k in range(21):
            victims = io_workers()
            assert victims, f"no IO worker after {k} kills:\n{s.log()[-2000:]}"
            pids.append(victims[0].pid)
            os.kill(victims[0].pid, signal.SIGKILL)
            if k < 20:
                wait_for(lambda: victims[0].pid not in [p.pid for p in io_workers()] and len(io_workers()) == 2,
                         30, f"IO worker restart {k + 1}")
        health = []
        deadline = time.monotonic() + 60
        while s.proc.poll() is None and not health and time.monotonic() < deadline:
            try:
                r = httpx.get(s.url + "/health", timeout=2)
                if r.status_code == 503 and "cannot be kept alive" in r.text:
                    health.append(r.json()["error"]["message"])
                    t0 = time.monotonic()
                    c = complete(s)
                    health.append((c.status_code, c.json()["error"]["message"], time.monotonic() - t0))
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        rc = s.proc.wait(60)
        assert rc != 0 and "cannot be kept alive" in s.log(), (rc, s.log()[-3000:])
        assert health and "io worker" in health[0] and "restarts" in health[0], (health, s.log()[-3000:])
        status, message, seconds = health[1]
        assert status == 503 and "cannot be kept alive" in message and seconds < 1.0, health[1]
        wait_for(lambda: not alive([p for p in map(_proc, pids) if p is not None]), 10, "children to go")
        assert shm_entries_of(pids) == []
    finally:
        s.stop(signal.SIGKILL)


def _proc(pid):
    import psutil
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
