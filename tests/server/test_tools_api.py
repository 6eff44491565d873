"""Tool calls, structured output and the new sampling fields through a real launcher (tiny random-weight model,
CPU, no mocks), with the official `openai` client and three clients nobody here wrote: LangChain
(langchain-openai), litellm and simonw's `llm`. One server for the module. The must-fail twins: the same
requests with the constraint switched off (tool_choice auto, no response_format) give invalid output on this
random-weight model."""
from __future__ import annotations

import json
import os

import httpx
import jsonschema_rs
import pytest

from tests.server.harness import Launcher

KEY = "tools-key"
DEFAULT_MAX_TOKENS = 48
LONG = 400          # a constrained answer of this random-weight model takes 50-300 tokens
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time in a zone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]


@pytest.fixture(scope="module")
def server(synth, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools-api")
    # a store of its own, so that this server always repacks (and /health says so) whatever ran before
    s = Launcher(synth("tiny", "nvfp4"), "--store", str(tmp / "store"), "--max-model-len", "1024",
                 "--cache-gb", "0.0005", "--log-level", "info",
                 "--max-tokens-default", str(DEFAULT_MAX_TOKENS),
                 "--default-chat-template-kwargs", '{"enable_thinking": false}', api_key=KEY)
    s.start(tmp / "launcher.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def post(server, path, body):
    return httpx.post(server.url + path, json=body, headers=server.headers(), timeout=120)


def validates(text, schema) -> bool:
    try:
        return jsonschema_rs.is_valid(schema, json.loads(text))
    except (TypeError, ValueError):
        return False


def valid_calls(calls) -> bool:
    if not calls:
        return False
    for c in calls:
        f = c["function"] if isinstance(c, dict) else c.function
        name, args = (f["name"], f["arguments"]) if isinstance(f, dict) else (f.name, f.arguments)
        try:
            if not jsonschema_rs.is_valid(SCHEMAS[name], json.loads(args)):
                return False
        except (KeyError, ValueError):
            return False
    return True


def test_health_said_repacking_then_loading_and_the_log_has_one_line_per_request(server, client, model):
    said = server.health_messages
    assert any(m.startswith("repacking (") and m.endswith(" %)") for m in said), said
    assert said[-1].startswith("loading"), said
    assert said.index(next(m for m in said if m.startswith("loading"))) > 0     # after the repacking
    before = server.log().count("moestream: request ")
    client.chat.completions.create(model=model, messages=ASK, max_tokens=3)
    lines = [ln for ln in server.log().splitlines() if ln.startswith("moestream: request ")]
    assert len(lines) == before + 1
    assert all(w in lines[-1] for w in ("prompt ", "cached", "generated 3", "TTFT", "tok/s", "hit rate", "finish"))
    assert '"GET /health' not in server.log()         # probes are not logged at INFO
    assert '"POST /v1/chat/completions' in server.log()      # the twin: other requests are


# ------------------------------------------------------------------------------------------------ openai client
def test_required_tool_call_is_a_valid_call(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", seed=1,
                                       max_tokens=LONG)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert valid_calls(ch.message.tool_calls), ch.message
    assert all(c.id.startswith("call_") and c.type == "function" for c in ch.message.tool_calls)
    assert not ch.message.content
    # must-fail twin: the same request unconstrained gives no valid call on this random-weight model
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", seed=1,
                                       max_tokens=LONG)
    assert not valid_calls(r.choices[0].message.tool_calls)
    assert r.choices[0].finish_reason != "tool_calls"


def test_named_tool_call_streams_as_deltas_that_join_into_the_non_streamed_call(client, model):
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, seed=2,
                                           max_tokens=LONG)
    calls = whole.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"] and valid_calls(calls)
    assert whole.choices[0].finish_reason == "stop"        # OpenAI's reading of a named tool_choice
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, seed=2,
                                                max_tokens=LONG, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert deltas[0].id and deltas[0].function.name == "get_time" and deltas[0].type == "function"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].function.arguments
    assert finish == "stop"


def test_tool_choice_none_returns_text(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", seed=3,
                                       max_tokens=40)
    m = r.choices[0].message
    assert m.tool_calls is None and isinstance(m.content, str) and m.content
    assert "<tool_call>" not in m.content


def test_parallel_tool_calls_false_gives_one_call(client, model):
    for seed in (4, 5):
        r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, seed=seed, max_tokens=LONG)
        assert len(r.choices[0].message.tool_calls) == 1


def test_tool_results_are_rendered_back(server, client, model):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "unit": "celsius"}'}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ids = post(server, "/tokenize", {"messages": msgs, "tools": TOOLS})
    assert ids.status_code == 200, ids.text
    text = post(server, "/detokenize", {"tokens": ids.json()["tokens"]}).json()["prompt"]
    assert "<parameter=city>\nParis\n</parameter>" in text and "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_json_schema_response_validates(client, model):
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    r = client.chat.completions.create(model=model, messages=ASK, response_format=rf, seed=6, max_tokens=LONG)
    assert r.choices[0].finish_reason == "stop"
    assert validates(r.choices[0].message.content, WEATHER)
    # must-fail twin: without the response_format the text is not JSON of that schema
    r = client.chat.completions.create(model=model, messages=ASK, seed=6)
    assert not validates(r.choices[0].message.content, WEATHER)


def test_json_object_is_a_json_object_whenever_the_answer_ends(client, model):
    """An object's keys are free strings, which this random-weight model rarely closes: a seeded answer that
    stops is a JSON object, one cut by max_tokens a prefix of one."""
    ended = 0
    for seed in range(4):
        ch = client.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                            seed=seed, max_tokens=LONG).choices[0]
        text = ch.message.content
        assert text.lstrip(" \t\n\r").startswith("{"), text
        if ch.finish_reason == "stop":
            ended += 1
            assert isinstance(json.loads(text), dict), text
    assert ended >= 1
    # must-fail twin: without the response_format the answer is not JSON
    r = client.chat.completions.create(model=model, messages=ASK, seed=0, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_bad_schema_and_refused_fields_are_400s(server, model):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
         "response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"best_of": 2}, "best_of"),
        ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         "continuous_usage_stats"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]
    for extra, param in cases:
        r = post(server, "/v1/chat/completions", {"model": model, "messages": ASK, "max_tokens": 2, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"], (extra, r.text)


# ------------------------------------------------------------------------------------------------ sampling fields
def test_logit_bias_and_penalties_are_applied(server, model):
    base = {"model": model, "messages": ASK, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    plain = post(server, "/v1/chat/completions", base).json()["choices"][0]["token_ids"]
    favoured = next(t for t in range(300, 1000) if t not in plain)
    biased = post(server, "/v1/chat/completions", {**base, "logit_bias": {str(favoured): 100}}).json()
    assert biased["choices"][0]["token_ids"] == [favoured] * 12
    # must-fail twin of the check: the unbiased run does not pick it at all
    assert favoured not in plain
    # greedy decoding of this model repeats itself within 40 tokens; the penalties make it repeat less
    long = {**base, "max_tokens": 40}
    plain = post(server, "/v1/chat/completions", long).json()["choices"][0]["token_ids"]
    assert len(set(plain)) < len(plain)
    for extra in ({"frequency_penalty": 2.0, "presence_penalty": 2.0}, {"repetition_penalty": 5.0}):
        ids = post(server, "/v1/chat/completions", {**long, **extra}).json()["choices"][0]["token_ids"]
        assert len(set(ids)) > len(set(plain)), extra
    sampled = {**long, "temperature": 1.0, "seed": 3}
    top_only = post(server, "/v1/chat/completions", {**sampled, "min_p": 1.0}).json()["choices"][0]["token_ids"]
    assert top_only == plain               # min_p 1 keeps only the most likely token: greedy again
    assert post(server, "/v1/chat/completions", sampled).json()["choices"][0]["token_ids"] != plain


def test_max_tokens_default_is_reported_and_applied(server, client, model):
    card = httpx.get(server.url + "/v1/models", headers=server.headers()).json()["data"][0]
    assert card["max_tokens_default"] == DEFAULT_MAX_TOKENS
    r = client.chat.completions.create(model=model, messages=ASK, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == DEFAULT_MAX_TOKENS and r.choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------------------------ third-party clients
def test_langchain_bind_tools_and_structured_output(server, model):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(model=model, base_url=server.url + "/v1", api_key=KEY, seed=7, max_retries=0, timeout=120,
                     max_tokens=LONG)
    msg = llm.bind_tools(TOOLS, tool_choice="required").invoke([HumanMessage(ASK[0]["content"])])
    assert msg.tool_calls and all(jsonschema_rs.is_valid(SCHEMAS[c["name"]], c["args"]) for c in msg.tool_calls)
    free = llm.bind_tools(TOOLS).invoke([HumanMessage(ASK[0]["content"])])
    assert not free.tool_calls                 # must-fail twin: unconstrained, no call

    class Time(BaseModel):
        zone: str = Field(json_schema_extra={"enum": ["UTC", "CET"]})
        minutes: int = Field(ge=0, le=59)

    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Time, method=method).invoke("What time is it in Berlin?")
        assert isinstance(out, Time) and out.zone in ("UTC", "CET"), method


def test_litellm_tools_and_json_schema(server, model):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    kw = dict(model="openai/" + model, api_base=server.url + "/v1", api_key=KEY, messages=ASK, seed=8,
              num_retries=0, timeout=120, max_tokens=LONG)
    r = litellm.completion(tools=TOOLS, tool_choice="required", **kw)
    assert valid_calls([c.model_dump() for c in r.choices[0].message.tool_calls])
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    r = litellm.completion(response_format=rf, **kw)
    assert validates(r.choices[0].message.content, WEATHER)


def test_simonw_llm_schema(server, model, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: moestream\n  model_name: {model}\n  api_base: {server.url}/v1\n  api_key_name: moestream\n"
        "  supports_schema: true\n  supports_tools: true\n")
    (tmp_path / "keys.json").write_text(json.dumps({"moestream": KEY}))
    import llm
    m = llm.get_model("moestream")
    assert validates(m.prompt("The weather in Paris?", schema=WEATHER, seed=9, max_tokens=LONG).text(), WEATHER)
    # `llm -o json_object 1`: an object (or, cut by max_tokens, the start of one)
    texts = [m.prompt("The weather in Paris?", json_object=True, seed=s, max_tokens=LONG).text() for s in range(3)]
    assert all(t.lstrip(" \t\n\r").startswith("{") for t in texts), texts
    assert any(validates(t, {"type": "object"}) for t in texts), texts


def _requests_total(server, finish: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "moestream_requests_total" and s.labels.get("finish_reason") == finish)


def test_a_cancelled_request_is_counted(server, model):
    import time
    before, done_before = _requests_total(server, "cancelled"), _requests_total(server, "length")
    body = {"model": model, "messages": ASK, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break                       # hang up after the first token
    deadline = time.monotonic() + 30
    while _requests_total(server, "cancelled") == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _requests_total(server, "cancelled") == before + 1
    # the twin: a request that runs to its end is counted under its own finish reason, not as cancelled
    post(server, "/v1/chat/completions", {"model": model, "messages": ASK, "max_tokens": 2, "ignore_eos": True})
    assert _requests_total(server, "length") == done_before + 1
    assert _requests_total(server, "cancelled") == before + 1
