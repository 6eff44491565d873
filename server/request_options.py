"""What a request asks beyond text in, text out: the fields that are refused with a 400 (never accepted and
ignored), `logit_bias` checked against the vocabulary, and for chat the tools: which calls are parsed out of the
answer and which grammar (server/constrained.py) constrains it."""
from __future__ import annotations

from dataclasses import dataclass

from server import constrained, tool_calls
from server.errors import APIError


def refuse_unsupported(req) -> None:
    """400 for fields this server cannot honour, naming each (a client that sends them learns it at once)."""
    best_of = getattr(req, "best_of", None)
    if best_of not in (None, 1):
        raise APIError(400, "best_of is not supported (one candidate per request)", param="best_of")
    so = getattr(req, "stream_options", None)
    if so is not None and getattr(so, "continuous_usage_stats", None):
        raise APIError(400, "stream_options.continuous_usage_stats is not supported: usage comes once, in the last "
                            "chunk (stream_options.include_usage)", param="stream_options.continuous_usage_stats")
    for legacy, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, legacy, None) is not None:
            raise APIError(400, f"{legacy} (deprecated by OpenAI) is not supported: use {instead}", param=legacy)


def logit_bias(req, vocab_size: int) -> dict[int, float]:
    """The request's logit_bias as {token id: bias}; a 400 naming a bad id or value."""
    given = getattr(req, "logit_bias", None) or {}
    out: dict[int, float] = {}
    for k, v in given.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise APIError(400, f"logit_bias: {k!r} is not a token id", param="logit_bias")
        if not 0 <= t < vocab_size:
            raise APIError(400, f"logit_bias: token id {t} is outside the vocabulary (0..{vocab_size - 1})",
                           param="logit_bias")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not -100 <= v <= 100:
            raise APIError(400, f"logit_bias: the bias of token {t} must be a number in [-100, 100], not {v!r}",
                           param="logit_bias")
        out[t] = float(v)
    return out


@dataclass
class ChatTools:
    """A chat request's tool handling: `parse` the answer for calls (with these tools' schemas), `grammar` the
    compute process applies (None: free), `named` a named function was forced (finish_reason then stays
    "stop", as OpenAI reports it)."""
    tools: dict[str, dict]
    parse: bool
    parallel: bool
    named: bool
    grammar: dict | None


def chat_tools(req, in_reasoning: bool) -> ChatTools:
    tools = tool_calls.check_tools(req.tools)
    choice = getattr(req, "tool_choice", None)
    parallel = getattr(req, "parallel_tool_calls", None) is not False
    if choice is not None and not tools and choice not in ("none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    grammar = constrained.for_chat(req.response_format, tools, choice if tools else None, parallel, in_reasoning)
    return ChatTools(tools=tools, parse=bool(tools) and choice != "none", parallel=parallel,
                     named=isinstance(choice, dict), grammar=grammar)
