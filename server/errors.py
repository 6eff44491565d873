"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}, as JSON or as an SSE event.
Messages reach clients without the server's absolute paths (those stay in the log), and every error response is
counted in /metrics by endpoint and reason."""
from __future__ import annotations

import json
import re
import sys
import traceback

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 501: "not_supported_error",
         503: "unavailable_error"}


# An absolute path: "/" at the start or after a space, quote or bracket, then two or more components (so
# "tokens/s", URLs and the API's own "/v1/..." routes are left alone).
_ABS_PATH = re.compile(r"""(?<![\w.:/~-])/(?!v1/)(?:[^\s'"`,;:()\[\]{}<>/]+/)+([^\s'"`,;:()\[\]{}<>/]*)""")


def without_paths(text: str) -> str:
    """`text` with each absolute path cut to its last component: where the server keeps its files is not the
    client's business (and tells an attacker the layout); the log keeps the full text."""
    return _ABS_PATH.sub(lambda m: m.group(1) or "…", text) if "/" in text else text


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, **extra):
        message = without_paths(message)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code, **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def count_failure(request_or_scope, status: int, code: str | None) -> None:
    """One failed request in /metrics (moestream_request_failures_total{endpoint, reason})."""
    scope = getattr(request_or_scope, "scope", request_or_scope)
    app = scope.get("app")
    ms = getattr(getattr(app, "state", None), "ms", None)
    if ms is not None:
        route = scope.get("route")
        ms.metrics.failed(getattr(route, "path", None) or scope.get("path", ""), code or TYPES.get(status, "error"))


def _loc(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    count_failure(request, 400, "invalid_request")
    if any(e.get("type") == "json_invalid" for e in errs):
        return APIError(400, "the request body is not valid JSON").response()
    msgs = []
    for e in errs[:5]:
        where = _loc(e.get("loc", ()))
        msgs.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    param = _loc(errs[0].get("loc", ())) if errs else None
    return APIError(400, "invalid request: " + "; ".join(msgs), param=param).response()


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    count_failure(request, exc.status_code, None)
    return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    count_failure(request, exc.status, exc.code)
    return exc.response()


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    print(f"server: {request.method} {request.url.path} failed:\n{traceback.format_exc()}", file=sys.stderr,
          flush=True)
    count_failure(request, 500, "internal_error")
    # Not a transient failure: tell the openai client not to resend the (expensive) request.
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                    headers={"x-should-retry": "false"}).response()
