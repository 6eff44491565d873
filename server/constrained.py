"""Constrained decoding, the request side: `response_format` (json_object, json_schema) and `tool_choice`
(none, required, a named function) as one xgrammar structural tag, checked here (a bad schema is a 400 before
the request is queued) and compiled against the vocabulary in the compute process, which applies its token
mask at every step (gpu_worker/grammar.py, gpu_worker/sampling.py).

Why xgrammar (bench/constrained_mask.py; the figures are in docs/serving.md): its per-token mask was cheaper than
llguidance's on both vocabularies, and it has the qwen3_coder XML parameter form of Nemotron's tool calls built in
(`style="qwen_xml"`: each parameter's value typed by the tool's JSON schema), which llguidance's Lark would have
to spell out per type.

Schemas are read strictly, `strict: true` or not: an object without `additionalProperties` gets no keys beyond
its `properties` (OpenAI's strict reading, and xgrammar's). An answer valid under that reading is valid under the
looser one too, so a non-strict schema is never broken, and a model cannot invent parameters; a schema that wants
more keys says `"additionalProperties": true`.

A prompt that leaves the model inside `<think>` (thinking on) gets a free reasoning block first, closed by
`</think>`; the constraint starts after it, as vLLM's structured outputs do with a reasoning parser.
"""
from __future__ import annotations

import json
import re

from server.errors import APIError

TOOL_BEGIN, TOOL_END = "<tool_call>\n<function={}>\n", "\n</function>\n</tool_call>"
# Consecutive whitespace allowed between JSON tokens: enough for indented JSON, and a bound on how long a model
# that favours whitespace (a random-weight one) can idle inside a constrained answer.
MAX_WHITESPACE = 8


def _json_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def response_format_format(rf: dict | None) -> dict | None:
    """The format of a `response_format` (None for text)."""
    if not rf:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")           # llama.cpp's extension: json_object with a schema
        if schema is None:
            return _json_format({"type": "object", "additionalProperties": True})
        return _json_format(_check_schema(schema, "response_format.schema"))
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError(400, "response_format.json_schema must be an object with a 'schema'",
                           param="response_format.json_schema")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            raise APIError(400, "response_format.json_schema.schema is missing", param="response_format.json_schema")
        return _json_format(_check_schema(schema, "response_format.json_schema.schema"))
    raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                   param="response_format.type")


def _check_schema(schema, where: str):
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise APIError(400, f"{where} must be a JSON schema object", param=where)
    return schema


def _tool_tag(name: str, params: dict) -> dict:
    return {"type": "tag", "begin": TOOL_BEGIN.format(name),
            "content": {"type": "json_schema", "json_schema": params, "style": "qwen_xml",
                        "max_whitespace_cnt": MAX_WHITESPACE}, "end": TOOL_END}


def tool_choice_format(tools: dict[str, dict], tool_choice, parallel: bool) -> dict | None:
    """The format of a `tool_choice` over the request's tools (name -> parameters schema); None for auto."""
    if tool_choice in (None, "auto"):
        return None
    if tool_choice == "none":
        return {"type": "any_text", "excludes": ["<tool_call>"]}
    if tool_choice == "required":
        if not tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        tags = [_tool_tag(n, p) for n, p in tools.items()]
        return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                "stop_after_first": not parallel}
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if name not in tools:
            raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools",
                           param="tool_choice")
        return _tool_tag(name, tools[name])
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                        "\"function\": {\"name\": …}}", param="tool_choice")


def structural_tag(fmt: dict, in_reasoning: bool) -> str:
    """The whole structural tag (JSON) for a format; with a free reasoning block first when the prompt opened
    `<think>`, and any whitespace the template puts before the answer."""
    elems = []
    if in_reasoning:
        elems.append({"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": ["<think>", "</think>"]},
                      "end": "</think>"})
    if fmt["type"] != "any_text":
        elems.append({"type": "regex", "pattern": r"[ \t\n\r]{0,2}"})     # JSON whitespace only
    elems.append(fmt)
    top = elems[0] if len(elems) == 1 else {"type": "sequence", "elements": elems}
    return json.dumps({"type": "structural_tag", "format": top})


def check(tag_json: str, param: str) -> None:
    """A 400 naming the problem when xgrammar cannot build the grammar (a bad schema, an unsupported keyword)."""
    import xgrammar as xgr
    try:
        xgr.Grammar.from_structural_tag(tag_json)
    except Exception as e:     # xgrammar raises RuntimeError / InvalidJSONError / InvalidStructuralTagError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        msg = re.sub(r"^\[[0-9:]+\] [^ ]+: ", "", first)       # "[09:39:30] /project/cpp/x.cc:4944: " off
        raise APIError(400, f"{param}: the schema cannot be used for constrained decoding: {msg}", param=param)


def for_chat(response_format: dict | None, tools: dict[str, dict], tool_choice, parallel: bool,
             in_reasoning: bool) -> dict | None:
    """The grammar message for the compute process ({'structural_tag': json}) or None when nothing is constrained."""
    rf = response_format_format(response_format)
    tc = tool_choice_format(tools, tool_choice, parallel) if tools or tool_choice not in (
        None, "auto", "none") else None
    if rf is not None and tc is not None and tc["type"] != "any_text":
        raise APIError(400, "response_format and a forced tool_choice cannot both constrain one answer",
                       param="response_format")
    fmt = rf or tc
    if fmt is None:
        return None
    tag = structural_tag(fmt, in_reasoning)
    check(tag, "response_format" if rf is not None else "tools")
    # the special tokens the grammar spells (the compute process keeps these, and only these, of the specials)
    keep = (["</think>"] if in_reasoning else []) + (
        ["<tool_call>", "</tool_call>"] if rf is None and tc["type"] != "any_text" else [])
    return {"structural_tag": tag, "special_tokens": keep}
