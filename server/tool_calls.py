"""Tool calls in Nemotron 3's chat-template form (the qwen3_coder XML that the template teaches the model):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A parameter's VALUE is raw text for a string and JSON otherwise (the template writes `v if v is string else
v | tojson`), so turning it back into OpenAI `arguments` (a JSON string) needs the tool's schema: "3" is the
number 3 for an integer parameter and the string "3" for a string one.

`ToolCallParser` reads the content text as it streams and turns it into content deltas and OpenAI tool-call
deltas (the first delta of a call carries `id`, `type` and `function.name`; later ones carry pieces of
`function.arguments`, which join into one JSON object); the non-streamed response is built from the same
events, so both agree. `messages_for_template` turns OpenAI messages that hold tool calls and tool results back
into what the template renders (arguments as mappings, tool content as text).
"""
from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass
from typing import Any

from server.errors import APIError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"


# ------------------------------------------------------------------------------------------------ requests
def check_tools(tools) -> dict[str, dict]:
    """name -> parameters schema of a request's `tools`; a 400 naming the problem otherwise."""
    out: dict[str, dict] = {}
    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise APIError(400, f"{where}: only tools of type 'function' are supported", param=where)
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, f"{where}.function.name: a tool needs a function with a name", param=where)
        name = f["name"]
        if any(c in name for c in "<>\n") or len(name) > 128:
            raise APIError(400, f"{where}.function.name: {name!r} cannot appear in the tool-call format "
                                "(no '<', '>', newlines; at most 128 characters)", param=where)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object", param=where)
        if params.get("type", "object") != "object":
            raise APIError(400, f"{where}.function.parameters: the schema's type must be 'object'", param=where)
        if name in out:
            raise APIError(400, f"{where}: two tools are named {name!r}", param=where)
        out[name] = params
    return out


def messages_for_template(msgs: list[dict]) -> list[dict]:
    """OpenAI chat messages as the Nemotron template reads them: an assistant's `tool_calls[].function.arguments`
    (a JSON string in the API) as a mapping, a tool result's content as text."""
    out = []
    for i, m in enumerate(msgs):
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                where = f"messages[{i}].tool_calls[{j}]"
                f = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    raise APIError(400, f"{where}: a tool call needs function.name", param=where)
                args = f.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError as e:
                        raise APIError(400, f"{where}.function.arguments is not valid JSON: {e}", param=where)
                if not isinstance(args, dict):
                    raise APIError(400, f"{where}.function.arguments must be a JSON object", param=where)
                calls.append({**tc, "type": "function", "function": {"name": f["name"], "arguments": args}})
            m["tool_calls"] = calls
        if m.get("role") == "tool":
            c = m.get("content")
            if isinstance(c, list):
                m["content"] = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in c)
            elif c is None:
                m["content"] = ""
        out.append(m)
    return out


# ------------------------------------------------------------------------------------------------ values
def _types(schema: dict | None) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out = []
    for key in ("anyOf", "oneOf"):
        for s in schema.get(key) or []:
            out += _types(s)
    if "enum" in schema and not out:
        out = ["string" if all(isinstance(v, str) for v in schema["enum"]) else "any"]
    if "const" in schema and not out:
        out = ["string" if isinstance(schema["const"], str) else "any"]
    return out


def convert_value(raw: str, schema: dict | None) -> Any:
    """A parameter's text (one leading and one trailing newline, which the template adds, removed) as the value
    its schema asks for; text that does not parse as the declared type stays a string (the client's validator
    then names the problem, rather than the server guessing)."""
    types = _types(schema)
    if "null" in types and raw.strip() == "null":
        return None                     # the template writes None as null; a nullable string prefers None
    if "string" in types:
        if _CONSTRAINED_STRING & set(schema):
            # the grammar (xgrammar's qwen_xml) reads such a value between optional whitespace: padding
            return raw.strip(" \n\r\t")
        return raw
    s = raw.strip()
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if "integer" in types:
        try:
            return int(s)
        except ValueError:
            pass
    if "number" in types:
        try:
            f = float(s)
            return int(f) if f.is_integer() and "." not in s and "e" not in s.lower() else f
        except ValueError:
            pass
    try:
        return json.loads(s)
    except ValueError:
        pass
    if types and set(types) & {"object", "array"}:
        try:
            v = ast.literal_eval(s)       # the model wrote a Python literal ({'a': 1}, [1, 2])
            if isinstance(v, (dict, list)):
                return v
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    return raw


_CONSTRAINED_STRING = {"enum", "const", "minLength", "maxLength", "pattern", "format"}


def _is_string(schema: dict | None) -> bool:
    """A free string: its text streams into the arguments as it comes (a constrained one waits for its end)."""
    return _types(schema) == ["string"] and not _CONSTRAINED_STRING & set(schema)


# ------------------------------------------------------------------------------------------------ the parser
@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    done: bool = False

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _held(buf: str, marks) -> int:
    """How many trailing characters of buf could be the start of one of the marks (kept back until known)."""
    hold = 0
    for m in marks:
        for k in range(min(len(m) - 1, len(buf)), 0, -1):
            if buf.endswith(m[:k]):
                hold = max(hold, k)
                break
    return hold


class ToolCallParser:
    """push(text) -> deltas, finish() -> deltas; each delta is ("content", str) or ("tool", dict) where the dict
    is one OpenAI `delta.tool_calls[]` entry. `calls` holds the parsed calls."""

    def __init__(self, tools: dict[str, dict], parallel: bool = True):
        self.tools = tools
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.buf = ""
        self.state = "text"       # text | call | func | value
        self.raw = ""             # the current call's text since <tool_call>, given back as content if malformed
        self.param = None         # (name, schema) of the value being read
        self.value = ""           # a non-string value's text so far
        self.value_started = False
        self.n_params = 0

    # ---- helpers --------------------------------------------------------------------------------
    def _args(self, s: str, out: list) -> None:
        call = self.calls[-1]
        call.arguments += s
        if s:
            out.append(("tool", {"index": call.index, "function": {"arguments": s}}))

    def _close_args(self, out: list) -> None:
        """Ends the current call's arguments JSON where the text stopped (cut short or malformed)."""
        if self.state == "value" and self.param is not None:
            if _is_string(self.param[1]):
                self._args(json.dumps(self.buf)[1:-1] + '"', out)
            else:
                self._args(json.dumps(convert_value(self.value + self.buf, self.param[1])), out)
            self.param = None
        self._args("}" if self.n_params else "{}", out)
        self.calls[-1].done = True

    def _content(self, text: str, out: list) -> None:
        if text:
            out.append(("content", text))

    # ---- the state machine ----------------------------------------------------------------------
    def push(self, text: str) -> list:
        out: list = []
        self.buf += text
        while self._step(out):
            pass
        return out

    def finish(self) -> list:
        out: list = []
        if self.state == "text":
            if self.buf.strip() or not self.calls:
                self._content(self.buf, out)
        elif self.state == "call":
            self._content(self.raw + self.buf, out)         # "<tool_call>" and no function: plain text
        elif self.state in ("func", "value"):
            self._close_args(out)                           # cut short (max_tokens): as far as it came
        self.calls and setattr(self.calls[-1], "done", True)
        self.state, self.buf, self.raw = "text", "", ""
        return out

    def _step(self, out: list) -> bool:
        b = self.buf
        if self.state == "text":
            if not self.parallel and self.calls:
                self.buf = ""               # one call was asked for: what follows it is dropped
                return False
            i = b.find(CALL_OPEN)
            if i < 0:
                # hold back what may start "<tool_call>" and the whitespace before it (dropped if a call follows)
                cut = len(b[:len(b) - _held(b, [CALL_OPEN])].rstrip())
                self._content(b[:cut], out)
                self.buf = b[cut:]
                return False
            if b[:i].strip():
                self._content(b[:i].rstrip(), out)
            self.raw, self.buf, self.state = CALL_OPEN, b[i + len(CALL_OPEN):], "call"
            return True
        if self.state == "call":
            s = b.lstrip()
            if not s or (FUNC_OPEN.startswith(s) and len(s) < len(FUNC_OPEN)):
                return False
            j = s.find(">")
            name = s[len(FUNC_OPEN):j] if j >= 0 else None
            if not s.startswith(FUNC_OPEN) or (j < 0 and ("\n" in s or len(s) > 200)) or \
                    (name is not None and name not in self.tools):
                self._content(self.raw + b, out)            # not a call of a known tool: plain text
                self.state, self.buf, self.raw = "text", "", ""
                return False
            if j < 0:
                return False
            call = ToolCall(len(self.calls), "call_" + uuid.uuid4().hex[:24], name)
            self.calls.append(call)
            out.append(("tool", {"index": call.index, "id": call.id, "type": "function",
                                 "function": {"name": name, "arguments": ""}}))
            self.buf, self.state, self.n_params = s[j + 1:], "func", 0
            return True
        if self.state == "func":
            s = b.lstrip()
            self.buf = s
            if not s:
                return False
            if s.startswith(PARAM_OPEN):
                j = s.find(">")
                if j < 0:
                    return False
                pname = s[len(PARAM_OPEN):j]
                schema = (self.tools[self.calls[-1].name].get("properties") or {}).get(pname)
                self.param = (pname, schema)
                self.value, self.value_started = "", False
                self._args(("{" if not self.n_params else ", ") + json.dumps(pname) + ": "
                           + ('"' if _is_string(schema) else ""), out)
                self.n_params += 1
                self.buf, self.state = s[j + 1:], "value"
                return True
            if s.startswith(FUNC_CLOSE):
                self._args("}" if self.n_params else "{}", out)
                self.buf, self.state = s[len(FUNC_CLOSE):], "close"
                return True
            if (PARAM_OPEN.startswith(s) or FUNC_CLOSE.startswith(s)):
                return False
            self._close_args(out)           # text inside <function> that is neither: the call ends here
            self.state, self.buf = "text", ""
            return False
        if self.state == "close":
            s = b.lstrip()
            self.buf = s
            if not s or (CALL_CLOSE.startswith(s) and len(s) < len(CALL_CLOSE)):
                return False
            self.calls[-1].done = True      # a missing </tool_call> is forgiven: </function> ended the call
            self.buf = s[len(CALL_CLOSE):] if s.startswith(CALL_CLOSE) else s
            self.state = "text"
            return True
        if self.state == "value":
            name, schema = self.param
            if not self.value_started:
                if not b:
                    return False
                b = b[1:] if b.startswith("\n") else b     # the template writes "<parameter=k>\n"
                self.value_started = True
            i = b.find(PARAM_CLOSE)
            if i >= 0:
                v = b[:i][:-1] if b[:i].endswith("\n") else b[:i]
                if _is_string(schema):
                    self._args(json.dumps(v)[1:-1] + '"', out)
                else:
                    self._args(json.dumps(convert_value(self.value + v, schema)), out)
                self.param = None
                self.buf, self.state = b[i + len(PARAM_CLOSE):], "func"
                return True
            keep = max(_held(b, ["\n" + PARAM_CLOSE, PARAM_CLOSE]), 1 if b.endswith("\n") else 0)
            ready, self.buf = b[:len(b) - keep], b[len(b) - keep:]
            if _is_string(schema):
                if ready:
                    self._args(json.dumps(ready)[1:-1], out)     # a string value streams as it comes
            else:
                self.value += ready
            return False
        raise AssertionError(self.state)


def parse(text: str, tools: dict[str, dict], parallel: bool = True) -> tuple[str, list[dict]]:
    """The whole text at once: (content, [OpenAI tool_calls])."""
    p = ToolCallParser(tools, parallel)
    content = "".join(s for kind, s in p.push(text) + p.finish() if kind == "content")
    return content, [c.openai() for c in p.calls]


class CallsInContent:
    """Routes a TextStream's content deltas through a ToolCallParser: `route(deltas)` and `finish(tail)` take
    {'reasoning', 'content'} dicts and return them with 'tool_calls' (OpenAI delta entries) added. Reasoning is
    never parsed for calls (a model thinking about a call has not made it)."""

    def __init__(self, tools: dict[str, dict], parallel: bool = True):
        self.parser = ToolCallParser(tools, parallel)

    def _split(self, deltas: dict, events: list) -> dict:
        calls: list[dict] = []
        for kind, d in events:
            if kind != "tool":
                continue
            if calls and calls[-1]["index"] == d["index"] and "id" not in d:
                calls[-1]["function"]["arguments"] += d["function"]["arguments"]   # one entry per call per chunk
            else:
                calls.append({**d, "function": dict(d["function"])})
        return {"reasoning": deltas.get("reasoning", ""),
                "content": "".join(s for kind, s in events if kind == "content"), "tool_calls": calls}

    def route(self, deltas: dict) -> dict:
        return self._split(deltas, self.parser.push(deltas.get("content", "")))

    def finish(self, tail: dict) -> dict:
        return self._split(tail, self.parser.push(tail.get("content", "")) + self.parser.finish())

    @property
    def calls(self) -> list[dict]:
        return [c.openai() for c in self.parser.calls]
