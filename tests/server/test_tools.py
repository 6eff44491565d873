"""Tool calls in Nemotron's template form (server/tool_calls.py): parsed into OpenAI tool_calls with arguments
typed by the tool's schema, streamed as deltas that join into the same calls at any chunking, and rendered back
through the chat template (assistant tool_calls, tool results) so that parsing the rendered text gives the
calls again. Each check has a must-fail twin."""
from __future__ import annotations

import json

import pytest

from server import tool_calls
from server.errors import APIError
from server.tool_calls import ToolCallParser, convert_value, parse

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "detail": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "hours": {"type": "array"},
        "unit": {"enum": ["celsius", "fahrenheit"]}, "note": {"type": ["string", "null"]},
        "zip": {"type": "string"}}},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}},
}


def call_text(name, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                   for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def stream(text, n, tools=TOOLS, parallel=True):
    """Feeds text n characters at a time; returns (content, [(name, arguments)]) rebuilt from the deltas."""
    p = ToolCallParser(tools, parallel)
    events = []
    for i in range(0, len(text), n):
        events += p.push(text[i:i + n])
    events += p.finish()
    content = "".join(s for kind, s in events if kind == "content")
    calls: dict[int, list] = {}
    for kind, d in events:
        if kind == "tool":
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = [d["function"]["name"], "", d["id"]]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    return content, [(c[0], c[1]) for _, c in sorted(calls.items())]


ARGS = {"city": 'Paris "center"\nline two', "days": 3, "detail": 0.5, "metric": True, "opts": {"a": [1, 2]},
        "hours": [6, 12], "unit": "celsius", "note": None, "zip": "10115"}
TEXT = "Let me check.\n" + call_text("get_weather", **ARGS) + "\n" + call_text("get_time", zone="UTC")


def test_calls_are_parsed_with_arguments_typed_by_the_schema():
    content, calls = parse(TEXT, TOOLS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGS
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "UTC"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_must_fail_twin_without_the_schema_the_types_are_wrong():
    untyped = {name: {"type": "object"} for name in TOOLS}
    _, calls = parse(TEXT, untyped)
    got = json.loads(calls[0]["function"]["arguments"])
    assert got["zip"] == 10115 and got != ARGS      # a string that reads as JSON is misread
    assert parse(call_text("get_time", zone="42"), TOOLS)[1][0]["function"]["arguments"] == '{"zone": "42"}'
    assert parse(call_text("get_time", zone="42"), {"get_time": {}})[1][0]["function"]["arguments"] == '{"zone": 42}'


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 1000])
def test_streamed_deltas_join_into_the_same_calls_at_any_chunking(n):
    content, calls = parse(TEXT, TOOLS)
    s_content, s_calls = stream(TEXT, n)
    assert s_content == content
    assert s_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_must_fail_twin_a_dropped_delta_is_noticed():
    p = ToolCallParser(TOOLS)
    events = []
    for ch in TEXT:
        events += p.push(ch)
    events += p.finish()
    args = [d["function"]["arguments"] for k, d in events if k == "tool" and "id" not in d and d["index"] == 0]
    assert "".join(args) == p.calls[0].arguments
    for i in range(len(args)):
        joined = "".join(args[:i] + args[i + 1:])
        try:
            assert json.loads(joined) != ARGS, i
        except ValueError:
            pass


def test_string_values_stream_before_their_parameter_closes():
    p = ToolCallParser(TOOLS)
    p.push("<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Ber")
    assert p.calls[0].arguments == '{"zone": "Europe/Ber'


def test_text_without_a_call_is_content_and_so_is_a_call_of_an_unknown_tool():
    for text in ["plain answer with a <b>tag</b> and <tool", "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
                 "<tool_call> not xml at all"]:
        for n in (1, 4, 100):
            assert stream(text, n) == (text, []), (text, n)


def test_a_call_cut_short_closes_its_arguments_as_far_as_they_came():
    for n in (1, 7):
        content, calls = stream("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", n)
        assert content == "" and json.loads(calls[0][1]) == {"city": "Par"}
        _, calls = stream("<tool_call>\n<function=get_weather>\n<parameter=days>\n1", n)
        assert json.loads(calls[0][1]) == {"days": 1}


def test_no_parallel_calls_keeps_the_first():
    _, calls = parse(TEXT, TOOLS, parallel=False)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_values_by_type():
    assert convert_value("3", {"type": "integer"}) == 3
    assert convert_value("3", {"type": "string"}) == "3"
    assert convert_value(" 2.5 ", {"type": "number"}) == 2.5
    assert convert_value("TRUE", {"type": "boolean"}) is True
    assert convert_value("null", {"type": ["integer", "null"]}) is None
    assert convert_value("{'a': 1}", {"type": "object"}) == {"a": 1}     # a Python literal
    assert convert_value(" UTC \n", {"type": "string", "enum": ["UTC"]}) == "UTC"
    assert convert_value("three", {"type": "integer"}) == "three"       # left for the client's validator


# ------------------------------------------------------------------------------------------------ rendering back
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from server.tokenizer import Tokenizer
    from tools.synth_tokenizer import write_tokenizer
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 1024)
    return Tokenizer(d)


OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]


def test_tool_calls_and_results_render_back_and_parse_to_the_same_calls(tok):
    _, calls = parse(TEXT, TOOLS)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": [{"type": "text", "text": "sunny"}]},
            {"role": "tool", "tool_call_id": calls[1]["id"], "content": "12:00"}]
    text = tok.render_chat(tool_calls.messages_for_template(msgs), True, OPENAI_TOOLS,
                           {"enable_thinking": False})
    assert "<tool_response>\nsunny\n</tool_response>" in text and "<tool_response>\n12:00\n</tool_response>" in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, again = parse(turn.removeprefix("<think></think>"), TOOLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in again] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    # must-fail twin: without messages_for_template the JSON-string arguments render no parameters
    raw = tok.render_chat(msgs[:2], False, OPENAI_TOOLS, {"enable_thinking": False})
    raw_turn = raw.split("<|im_start|>assistant\n")[1]
    assert "<function=get_weather>" in raw_turn and "<parameter=" not in raw_turn


@pytest.mark.parametrize("msg,match", [
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}, "not valid JSON"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, "JSON object"),
    ({"role": "assistant", "tool_calls": [{"id": "x"}]}, "function.name"),
])
def test_bad_tool_calls_in_history_are_a_400(msg, match):
    with pytest.raises(APIError, match=match) as e:
        tool_calls.messages_for_template([msg])
    assert e.value.status == 400


@pytest.mark.parametrize("tools,match", [
    ([{"type": "retrieval"}], "only tools of type 'function'"),
    ([{"type": "function", "function": {}}], "needs a function with a name"),
    ([{"type": "function", "function": {"name": "a<b"}}], "cannot appear"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "must be 'object'"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "two tools"),
])
def test_bad_tools_are_a_400(tools, match):
    with pytest.raises(APIError, match=match):
        tool_calls.check_tools(tools)
