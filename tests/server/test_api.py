"""The OpenAI-compatible API of a real launcher process (tiny synthetic model, CPU), through the official
`openai` client and raw HTTP. One server for the module."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import Launcher

KEY = "test-key"
MAX_LEN = 128
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(synth, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    s = Launcher(synth("tiny", "nvfp4"), "--max-model-len", str(MAX_LEN), "--max-queue", "300",
                 "--snapshot-dir", str(tmp / "snaps"), "--cache-gb", "0.0005", api_key=KEY)
    s.start(tmp / "launcher.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def model(server):
    return server.openai().models.list().data[0].id


def post(server, path, body, headers=None, **kw):
    h = server.headers() if headers is None else headers
    return httpx.post(server.url + path, json=body, headers=h, timeout=120, **kw)


def metric(server, name, labels=None) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return s.value
    raise KeyError(name)


# ------------------------------------------------------------------------------------------------ basics
def test_health_models_and_loading_was_503(server, model):
    assert server.health_seen[-1] == 200
    assert 503 in server.health_seen, f"/health never said 503 while loading: {server.health_seen}"
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    data = httpx.get(server.url + "/v1/models", headers=server.headers()).json()["data"]
    assert [m["id"] for m in data] == [model] and data[0]["max_model_len"] == MAX_LEN


def test_api_key_required_on_v1_but_not_on_health(server, model):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


# ------------------------------------------------------------------------------------------------ generation
def chat(client, model, seed=7, stream=False, **kw):
    args = dict(model=model, messages=[{"role": "user", "content": "Tell me about the fox."}], max_tokens=16,
                temperature=0.9, seed=seed, extra_body=dict(NO_THINK, ignore_eos=True))
    args.update(kw)
    if not stream:
        return client.chat.completions.create(**args)
    return list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))


def test_streamed_equals_non_streamed_under_a_seed(client, model):
    full = chat(client, model)
    chunks = chat(client, model, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content and text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_same_seed_same_text_other_seed_other_text(client, model):
    a, b, c = (chat(client, model, seed=s).choices[0].message.content for s in (11, 11, 12))
    assert a == b
    assert a != c, "the seed does not reach the sampler"


def test_sse_wire_format(server, model):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **NO_THINK}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert len({o["id"] for o in objs}) == 1
    choice_chunks = [o for o in objs if o["choices"]]
    assert choice_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in o["choices"][0]["delta"] for o in choice_chunks[1:])
    assert [o["choices"][0]["finish_reason"] for o in choice_chunks][-1] == "length"
    assert all(o["choices"][0]["finish_reason"] is None for o in choice_chunks[:-1])
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 6
    # without include_usage: no usage chunk
    body["stream_options"] = None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers()) as r:
        objs = [json.loads(e[6:]) for e in r.read().decode().split("\n\n") if e.startswith("data: {")]
    assert all(o["choices"] for o in objs)


def test_max_tokens_and_max_completion_tokens(client, model):
    r = chat(client, model, max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = chat(client, model, max_tokens=None, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3
    r = chat(client, model, max_tokens=9, max_completion_tokens=2)     # the newer field wins, as in vLLM
    assert r.usage.completion_tokens == 2


def completion(server, model, **kw):
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **kw}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_strings(server, model):
    full = completion(server, model)["choices"][0]
    text = full["text"]
    cut = next(i for i in range(6, len(text) - 3) if text[i:i + 3].isprintable() and text[i:i + 3].strip())
    stop = text[cut:cut + 3]
    first = text.find(stop)
    r = completion(server, model, stop=[stop, "never-in-the-output-xyz"])["choices"][0]
    assert r["text"] == text[:first] and r["finish_reason"] == "stop"
    twin = completion(server, model, stop="never-in-the-output-xyz")["choices"][0]
    assert twin["text"] == text and twin["finish_reason"] == "length"


def test_stop_token_ids(server, model):
    full = completion(server, model)["choices"][0]
    ids = full["token_ids"]
    k = 5
    stop_id = ids[k]
    first = ids.index(stop_id)
    r = completion(server, model, stop_token_ids=[stop_id])["choices"][0]
    assert r["token_ids"] == ids[:first + 1] and r["finish_reason"] == "stop"


def test_eos_stops_unless_ignored(server, model):
    """With ignore_eos the model's own end tokens do not stop a run (it goes to max_tokens, through any it
    chooses); without it the same seeded run ends at the first of them."""
    long = completion(server, model, max_tokens=MAX_LEN - 8, temperature=1.0, seed=3)["choices"][0]
    eos = {2, 11}
    assert long["finish_reason"] == "length" and len(long["token_ids"]) == MAX_LEN - 8
    r = completion(server, model, max_tokens=MAX_LEN - 8, temperature=1.0, seed=3, ignore_eos=False)["choices"][0]
    first = next((i for i, t in enumerate(long["token_ids"]) if t in eos), None)
    if first is None:
        assert r["token_ids"] == long["token_ids"]
    else:
        assert r["token_ids"] == long["token_ids"][:first + 1] and r["finish_reason"] == "stop"


def test_logprobs(client, model):
    r = chat(client, model, temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.logprob == pytest.approx(tops[0], abs=1e-6)      # greedy picks the most likely token
    assert chat(client, model, temperature=0).choices[0].logprobs is None


def test_completion_logprobs_and_echo(server, model):
    r = completion(server, model, max_tokens=4, logprobs=2, echo=True)["choices"][0]
    lp = r["logprobs"]
    assert len(lp["tokens"]) == 4 and all(len(t) == 2 for t in lp["top_logprobs"])
    assert r["text"].startswith("The quick brown fox")


def test_reasoning_split_follows_enable_thinking(server, model, client):
    msgs = [{"role": "user", "content": "Why?"}]
    on = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    off = post(server, "/tokenize", {"messages": msgs, **NO_THINK}).json()["tokens"]
    assert on[-2:] == [12, 218] and off[-2:] == [12, 13]        # "<think>\n" vs "<think></think>"
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    m = r.choices[0].message
    reasoning = getattr(m, "reasoning_content", None) or (m.model_extra or {}).get("reasoning_content")
    assert reasoning, "thinking on: the text inside <think> goes to reasoning_content"
    r2 = chat(client, model, temperature=0, max_tokens=8, messages=msgs)
    assert not (r2.choices[0].message.model_extra or {}).get("reasoning_content")
    assert r2.choices[0].message.content


def test_tokenize_detokenize(server, model):
    r = post(server, "/tokenize", {"model": model, "prompt": "The quick brown fox"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == MAX_LEN
    back = post(server, "/detokenize", {"model": model, "tokens": r["tokens"]}).json()["prompt"]
    assert back == "The quick brown fox"
    assert post(server, "/detokenize", {"tokens": [10 ** 6]}).status_code == 400


# ------------------------------------------------------------------------------------------------ errors
def err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"} and e["message"]
    return e


def test_errors_in_the_openai_shape(server, model):
    h = dict(server.headers(), **{"content-type": "application/json"})
    e = err(httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers=h), 400)
    assert e["type"] == "invalid_request_error"
    e = err(post(server, "/v1/chat/completions", {"model": model}), 400)
    assert e["param"] == "messages"
    err(post(server, "/v1/chat/completions", {"model": model, "messages": []}), 400)
    err(post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                              "temperature": -1}), 400)
    err(post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                              "n": 2}), 400)
    err(post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "nobody", "content": "x"}]}), 400)
    err(post(server, "/v1/completions", {"model": model, "prompt": [5, 10 ** 7]}), 400)
    err(post(server, "/v1/completions", {"model": model, "prompt": ""}), 400)
    e = err(post(server, "/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
            404)
    assert e["code"] == "model_not_found" and e["param"] == "model"
    # the twin: the right model name passes
    assert post(server, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_context_too_long(server, model, client):
    for stream in (False, True):
        e = err(post(server, "/v1/completions", {"model": model, "prompt": [20] * (MAX_LEN + 5), "stream": stream}),
                400)
        assert e["code"] == "context_length_exceeded" and e["n_prompt_tokens"] == MAX_LEN + 5
        assert e["n_ctx"] == MAX_LEN and str(MAX_LEN) in e["message"]
    e = err(post(server, "/v1/completions", {"model": model, "prompt": [20] * 100, "max_tokens": 50}), 400)
    assert e["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=[20] * (MAX_LEN + 1))
    r = completion(server, model, prompt=[20] * 100, max_tokens=MAX_LEN - 100)     # the twin: exactly fits
    assert r["usage"]["total_tokens"] == MAX_LEN


# ------------------------------------------------------------------------------------------------ snapshots
def test_second_turn_prefills_only_the_tail_and_answers_the_same(server, client, model):
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    r1 = chat(client, model, temperature=0, messages=turn1, max_tokens=6)
    base = post(server, "/tokenize", {"messages": turn1, "add_generation_prompt": False, **NO_THINK}).json()["count"]
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Another one."}]
    with_snap = post(server, "/v1/chat/completions", {
        "model": model, "messages": turn2, "max_tokens": 8, "temperature": 0, "logprobs": True, "ignore_eos": True,
        **NO_THINK}).json()
    without = post(server, "/v1/chat/completions", {
        "model": model, "messages": turn2, "max_tokens": 8, "temperature": 0, "logprobs": True, "ignore_eos": True,
        "cache_prompt": False, **NO_THINK}).json()
    cached = with_snap["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= base, (cached, base)
    assert with_snap["timings"]["prompt_n"] == with_snap["usage"]["prompt_tokens"] - cached
    assert without["usage"]["prompt_tokens_details"]["cached_tokens"] == 0          # the twin
    assert with_snap["choices"][0]["message"] == without["choices"][0]["message"]
    a = [e["logprob"] for e in with_snap["choices"][0]["logprobs"]["content"]]
    b = [e["logprob"] for e in without["choices"][0]["logprobs"]["content"]]
    assert a == pytest.approx(b, abs=1e-4)


def test_completion_continues_from_the_exact_end_of_the_previous_one(server, model):
    a = [30 + i for i in range(20)]
    r1 = completion(server, model, prompt=a, max_tokens=6)["choices"][0]
    out = r1["token_ids"]
    r2 = completion(server, model, prompt=a + out + [40, 41, 42], max_tokens=4)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(a) + len(out) - 1
    r3 = completion(server, model, prompt=a + out + [40, 41, 42], max_tokens=4, cache_prompt=False)
    assert r3["choices"][0]["token_ids"] == r2["choices"][0]["token_ids"]
    r4 = completion(server, model, prompt=[31] + a + out, max_tokens=1)     # not a prefix: a miss
    assert r4["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# ------------------------------------------------------------------------------------------------ metrics
def test_metrics(server, model):
    before = metric(server, "moestream_generation_tokens_total")
    ttft_before = metric(server, "moestream_time_to_first_token_seconds_count")
    prefilled_before = metric(server, "moestream_prefill_tokens_total")
    r = completion(server, model, max_tokens=7, prompt="A metrics probe, a prompt of its own")
    prefilled = metric(server, "moestream_prefill_tokens_total") - prefilled_before
    assert prefilled == r["usage"]["prompt_tokens"] - r["usage"]["prompt_tokens_details"]["cached_tokens"] > 1
    assert metric(server, "moestream_last_prefill_tokens_per_second") > 0
    assert metric(server, "moestream_last_prefill_distinct_experts") > 0
    assert 0 <= metric(server, "moestream_last_prefill_missing_at_start") <= metric(
        server, "moestream_last_prefill_distinct_experts")
    assert metric(server, "moestream_prefill_blocks_read_total") >= 0
    assert metric(server, "moestream_generation_tokens_total") == before + 7
    assert metric(server, "moestream_time_to_first_token_seconds_count") == ttft_before + 1
    assert 0 < metric(server, "moestream_expert_cache_hit_rate") <= 1
    assert metric(server, "moestream_bytes_from_disk_total") > 0
    assert metric(server, "moestream_expert_cache_warm_reads_total") >= 0      # named (--warm-cache)
    assert metric(server, "moestream_prefetch_refused_total") >= 0
    assert metric(server, "moestream_bytes_from_disk_per_token") >= 0
    assert metric(server, "moestream_bytes_over_pcie_per_token") == 0          # CPU: nothing crosses a bus
    assert metric(server, "moestream_ms_per_token", {"part": "total"}) > 0
    assert metric(server, "moestream_ms_per_token", {"part": "experts"}) > 0
    assert metric(server, "moestream_requests_waiting") == 0
    assert metric(server, "moestream_decode_tokens_per_second") > 0
    assert metric(server, "moestream_snapshots_in_ram") >= 1
    # the prompt's stretches between added tokens: a chat's system message, sent again, is found in the memo
    reused = metric(server, "moestream_prompt_stretches_reused_total")
    encoded = metric(server, "moestream_prompt_stretches_encoded_total")
    chat = [{"role": "system", "content": "A system prompt the memo keeps"}, {"role": "user", "content": "one"}]
    for question in ("one", "two"):
        chat[1]["content"] = question
        server.openai().chat.completions.create(model=model, messages=chat, max_tokens=1)
    assert metric(server, "moestream_prompt_stretches_encoded_total") > encoded
    assert metric(server, "moestream_prompt_stretches_reused_total") > reused


def test_a_killed_io_worker_or_prefetcher_goes_unnoticed(server, model):
    """The cache supervisor restarts them; requests keep their answers."""
    import psutil
    before = completion(server, model, prompt="cache processes", max_tokens=6)["choices"][0]["token_ids"]
    for name in ("io_workers.reader", "prefetcher"):
        victim = next(p for p in server.descendants() if name in " ".join(p.cmdline()))
        victim.kill()
        psutil.wait_procs([victim], timeout=10)
        after = completion(server, model, prompt="cache processes", max_tokens=6, cache_prompt=False)
        assert after["choices"][0]["token_ids"] == before
    assert httpx.get(server.url + "/health").status_code == 200


# ------------------------------------------------------------------------------------------------ load
def _clients_in_order(server, model) -> int:
    """Eight clients, each sent once the ones before it are in the server; asserts they finish in arrival order
    with 200s and returns the most that waited at once."""
    done, lock = [], threading.Lock()

    def one(i):
        # the first runs as long as the context allows, so that the others queue behind it (100 tokens took
        # 0.55 s here with the device sampler, about as long as the seven arrivals' /metrics polls)
        r = post(server, "/v1/completions", {"model": model, "prompt": [20] * 4 if i == 0 else f"client {i}",
                                             "ignore_eos": True, "max_tokens": MAX_LEN - 4 if i == 0 else 4})
        with lock:
            done.append((i, r.status_code))

    def arrived(i) -> bool:
        """Requests 0..i are all in the server: finished, computing or queued."""
        with lock:
            finished = len(done)
        in_server = metric(server, "moestream_requests_running") + metric(server, "moestream_requests_waiting")
        return finished + in_server >= i + 1

    threads, peak = [], 0
    for i in range(8):
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 30
        while not arrived(i):            # so that arrival order is the order of i
            assert time.monotonic() < deadline, f"request {i} never reached the server"
            time.sleep(0.01)
        peak = max(peak, metric(server, "moestream_requests_waiting"))
    for t in threads:
        t.join(120)
    assert [c for _, c in done] == [200] * 8
    assert [i for i, _ in done] == list(range(8))
    return peak


def test_concurrent_clients_are_served_in_order(server, model):
    # on a loaded machine the arrivals' /metrics polls can outlast the first request, and then nobody queues: such
    # a round still checks the order but proves no queueing, so up to three rounds are run until one queued
    for _ in range(3):
        peak = _clients_in_order(server, model)
        if peak >= 2:
            break
    assert peak >= 2, "the clients never queued in three rounds: the test proves nothing"


def test_timed_out_clients_are_cancelled(server, model):
    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=0.5)
        calls = [c.completions.create(model=model, prompt="hello " * 5, max_tokens=MAX_LEN - 40,
                                      extra_body={"ignore_eos": True}) for _ in range(200)]
        res = await asyncio.gather(*calls, return_exceptions=True)
        await c.close()
        return res

    res = asyncio.run(run())
    # 88 tokens of the tiny model can finish inside the 0.5 s timeout on an idle machine: the requests reached
    # first may complete; the rest, queued behind them, must have been abandoned by the client
    timed_out = sum(isinstance(r, openai.APITimeoutError) for r in res)
    assert {type(r).__name__ for r in res} <= {"APITimeoutError", "Completion"}
    assert timed_out >= len(res) - 3, {type(r).__name__ for r in res}
    t0 = time.monotonic()
    r = completion(server, model, max_tokens=4)
    assert r["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t0 < 5, "the abandoned requests were not cancelled"
    assert metric(server, "moestream_requests_waiting") == 0


# ------------------------------------------------------------------------------------------------ fuzzing
@pytest.fixture(scope="module")
def api_schema(server):
    import schemathesis
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def _schema():
    import schemathesis
    return schemathesis.pytest.from_fixture("api_schema")


schema = _schema()


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_schemathesis_finds_no_server_error(case, server):
    """Every operation of /openapi.json, with generated bodies (valid and not): never a 5xx, and every answer's
    status code, content type, headers and body as the document says. (A few examples per operation, no
    per-example deadline: an example may generate up to --max-model-len tokens on a CPU.)"""
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                     response_schema_conformance, status_code_conformance)
    case.call_and_validate(headers=server.headers(), timeout=60,
                           checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                   response_headers_conformance, response_schema_conformance])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_conforms_to_the_document(api_schema, server, model, path):
    """The generated cases above reach a 200 stream only sometimes; this one always does, so the document's
    description of a server-sent event is checked on every run (an event is an object with `data`)."""
    from schemathesis.checks import content_type_conformance, response_schema_conformance
    body = {"model": model, "max_tokens": 3, "stream": True}
    body.update({"prompt": "hello"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hello"}], **NO_THINK})
    case = api_schema[path]["POST"].Case(body=body, media_type="application/json")
    case.call_and_validate(headers=server.headers(), timeout=60,
                           checks=[content_type_conformance, response_schema_conformance])
