"""What a request may cost the API process (issue 16.1, 16.4, 16.6): a body over the limit is refused from its
Content-Length or as it streams, in under a second and without the launcher's memory growing; a prompt over the
context is refused after tokenizing a bounded part of it, off the event loop; lone surrogates are a 400 on every
text route; no server path reaches a client; failures are counted by reason."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import psutil
import pytest

from tests.server.harness import Launcher

MAX_LEN = 128
BODY_MB = 1


@pytest.fixture(scope="module")
def server(synth, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    s = Launcher(synth("tiny", "nvfp4"), "--max-model-len", str(MAX_LEN), "--max-body-mb", str(BODY_MB))
    s.start(tmp / "launcher.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def rss(server) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


class PeakRSS(threading.Thread):
    def __init__(self, server):
        super().__init__(daemon=True)
        self.p, self.peak, self.done = psutil.Process(server.proc.pid), 0, threading.Event()
        self.start()

    def run(self):
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, self.p.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.01)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


def post_raw(server, head: bytes, body_chunks=(), timeout: float = 5.0) -> tuple[float, bytes]:
    """Send the request head, then body chunks until the server answers; (seconds to the answer, answer)."""
    s = socket.create_connection(("127.0.0.1", httpx.URL(server.url).port))
    t0 = time.monotonic()
    try:
        s.sendall(head)
        got = b""
        for chunk in body_chunks:
            s.settimeout(0)
            try:
                got = s.recv(65536)
                if got:
                    break
            except BlockingIOError:
                pass
            s.settimeout(timeout)
            try:
                s.sendall(chunk)
            except OSError:         # the server stopped reading: its answer is what counts
                break
        s.settimeout(timeout)
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            more = s.recv(65536)
            if not more:
                break
            got += more
        return time.monotonic() - t0, got
    finally:
        s.close()


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_body_over_the_limit_by_content_length_is_413_at_once(server):
    before = rss(server)
    peak = PeakRSS(server)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 << 20}\r\n\r\n").encode()
    try:
        seconds, answer = post_raw(server, head, [b"x" * (1 << 20)] * 50)
    finally:
        growth = peak.stop() - before
    status, err = status_and_error(answer)
    assert status == 413 and err["type"] == "invalid_request_error" and err["code"] == "request_too_large", err
    assert seconds < 1.0 and growth < 100 << 20, (seconds, growth)
    assert httpx.get(server.url + "/health").status_code == 200


def test_streamed_body_over_the_limit_is_413_once_the_limit_is_passed(server):
    """No Content-Length (chunked): the body is read up to the limit, then refused; 50 MB would follow."""
    before = rss(server)
    peak = PeakRSS(server)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * (64 << 10)
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    try:
        seconds, answer = post_raw(server, head, [chunk] * 800)
    finally:
        growth = peak.stop() - before
    status, err = status_and_error(answer)
    assert status == 413 and err["code"] == "request_too_large", err
    assert seconds < 1.0 and growth < 100 << 20, (seconds, growth)


def test_body_under_the_limit_is_served(server, model):
    """The twin: a body of most of the limit, with a short prompt, is read whole and answered."""
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "The fox", "max_tokens": 2,
                                                         "ignore_eos": True, "padding": "x" * (900 << 10)},
                   timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["completions", "chat", "tokenize"])
def test_prompt_over_the_context_is_refused_without_tokenizing_it_all(server, model, route):
    """900 KB of text (tokenizing all of it takes seconds here) against a 128-token context: refused in well
    under a second while /health keeps answering at once."""
    text = "word " * 180_000
    body = ({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1} if route == "chat"
            else {"model": model, "prompt": text, "max_tokens": 1})
    url = server.url + {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize"}[route]
    results = []
    threads = [threading.Thread(target=lambda: results.append(httpx.post(url, json=body, timeout=60)))
               for _ in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    health_s = []
    while any(t.is_alive() for t in threads):
        h0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        health_s.append(time.monotonic() - h0)
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    assert [r.status_code for r in results] == [400] * 3
    err = results[0].json()["error"]
    assert err["code"] == "context_length_exceeded" and f"{MAX_LEN} tokens" in err["message"], err
    assert seconds < 2.0 and max(health_s, default=0) < 0.5, (seconds, health_s)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 1}),
    ("/v1/completions", {"prompt": ["a\udc00b"], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "ok", "stop": ["\ud800"], "max_tokens": 1}),
    ("/tokenize", {"prompt": "a\ud800b"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}],
                              "max_tokens": 1}),
    ("/detokenize", {"model": "m\ud800", "tokens": [1]}),
])
def test_lone_surrogates_are_a_400_on_every_text_route(server, model, path, body):
    body = {"model": model, **body}
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_text" and "lone surrogate" in err["message"] and err["param"], err


def test_valid_non_ascii_text_passes_the_surrogate_check(server, model):
    """The twin: a real astral character (a surrogate *pair* in JSON) is text, and is served."""
    body = {"model": model, "prompt": "a\ud83d\ude00b", "max_tokens": 1, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", content=json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(server.url + "/tokenize", json={"model": model, "prompt": "a😀b"}).status_code == 200


def test_models_root_is_no_server_path(server, model):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["root"] == model and not card["root"].startswith("/")
    assert str(server.argv[server.argv.index("--model") + 1]) not in httpx.get(server.url + "/v1/models").text


def test_failures_are_counted_by_reason(server, model):
    from prometheus_client.parser import text_string_to_metric_families
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {2 << 20}\r\n\r\n").encode()
    post_raw(server, head)
    httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1,
                                                     "best_of": 2})     # refused: one candidate per request
    counts = {}
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for smp in fam.samples:
            if smp.name == "moestream_request_failures_total":
                counts[(smp.labels["endpoint"], smp.labels["reason"])] = smp.value
    assert counts.get(("/v1/completions", "request_too_large"), 0) >= 1, counts
    assert counts.get(("/v1/completions", "invalid_request_error"), 0) >= 1, counts
