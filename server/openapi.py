"""What /openapi.json says each route answers: the 200 bodies as the handlers build them, the error responses
(400/401/404/413/500/503 in the OpenAI error shape, as server/errors.py builds them), streams as
text/event-stream and /metrics as Prometheus text. Generated SDKs and schemathesis' conformance checks read
this, so it must be the truth; the handlers return plain dicts (these models only document them)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[str, int, None] = None


class ErrorBody(_Open):
    error: ErrorDetail


class Unavailable(_Open):
    status: Literal["unavailable"]
    error: ErrorDetail


class Health(_Open):
    status: Literal["ok"]


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    max_tokens_default: int


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class Tokens(_Open):
    count: int
    max_model_len: int
    tokens: list[int]


class Text(_Open):
    prompt: str


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[dict[str, int]] = None
    completion_tokens_details: Optional[dict[str, int]] = None


class ToolCallFunction(_Open):
    name: str
    arguments: str


class ToolCall(_Open):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    finish_reason: Optional[str] = None
    logprobs: Optional[dict[str, Any]] = None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Optional[dict[str, Any]] = None


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: Optional[str] = None
    logprobs: Optional[dict[str, Any]] = None


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Optional[dict[str, Any]] = None


_WHY = {400: "invalid request: the message and `param` name the problem",
        401: "missing or wrong API key",
        404: "no such model",
        413: "request body too large",
        500: "the compute process failed (not retried: `x-should-retry: false`)",
        503: "loading, restarting, shutting down or busy (`Retry-After`)"}
# one server-sent event, as SSE clients (and schemathesis' stream checks) parse it: `data` is a JSON chunk or [DONE]
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}},
    "description": "`data: {chunk}` events, then `data: [DONE]`"}}}


def errors(*codes: int) -> dict:
    return {c: {"model": ErrorBody, "description": _WHY[c]} for c in codes}


def generation(model: type[BaseModel]) -> dict:
    """A generation route: JSON, or an SSE stream when `stream` is true; and its errors."""
    return {200: {"model": model, "description": "the answer; with `stream: true` an SSE stream",
                  "content": _SSE}, **errors(400, 401, 404, 413, 500, 503)}


HEALTH = {200: {"model": Health, "description": "serving"},
          503: {"model": Unavailable, "description": "loading, restarting, shutting down or failed"}}
METRICS = {200: {"description": "Prometheus text exposition format",
                 "content": {"text/plain": {"schema": {"type": "string"}}}}}


def drop_unused_422(schema: dict) -> dict:
    """FastAPI documents a 422 for every body; this server answers invalid bodies with 400 (errors.py)."""
    for path in schema.get("paths", {}).values():
        for op in path.values():
            if isinstance(op, dict):
                op.get("responses", {}).pop("422", None)
    comps = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    return schema
