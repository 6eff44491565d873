"""What one request may cost the API process, checked before the cost is paid: the body's size (read no further
than the limit), the text's validity (no lone surrogates: the tokenizer cannot encode them), and the prompt's
length in tokens (tokenizing stops soon after the context limit is passed, however long the text is)."""
from __future__ import annotations

import json
import re

from server.errors import APIError

MiB = 1 << 20
BASE_BODY_BYTES = 16 * MiB      # images as data URLs, tools, a long conversation
BODY_BYTES_PER_TOKEN = 64       # a context of text, JSON-escaped, with room to spare


def default_max_body_bytes(max_model_len: int) -> int:
    return BASE_BODY_BYTES + BODY_BYTES_PER_TOKEN * max_model_len


# ------------------------------------------------------------------------------------------------ body size
class BodyLimit:
    """ASGI middleware: a request body over `max_bytes()` gets 413 in the OpenAI error shape, from its
    Content-Length before a byte of it is read, else (chunked) as soon as the bytes read pass the limit. The body
    is read here, up to the limit, and handed to the app as one message."""

    def __init__(self, app, max_bytes, on_reject=None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = self.max_bytes()
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._reject(scope, send, limit, f"{int(length):,} bytes")
        chunks, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return              # the client left before its body was complete
            body = msg.get("body", b"")
            n += len(body)
            if n > limit:
                return await self._reject(scope, send, limit, f"more than {limit:,} bytes")
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()      # after the body: the disconnect that generation watches for

        await self.app(scope, replay, send)

    async def _reject(self, scope, send, limit: int, got: str):
        if self.on_reject is not None:
            self.on_reject(scope["path"])
        e = APIError(413, f"the request body ({got}) is larger than this server's limit of {limit:,} bytes "
                          "(--max-body-mb)", code="request_too_large")
        body = json.dumps(e.body()).encode()
        # No "connection: close": closing with the body unread makes the kernel reset the connection, and a client
        # still sending loses the answer with it. Kept open, the server discards the rest of the body unread
        # (uvicorn drops data after a complete response) until its keep-alive timeout.
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


# ------------------------------------------------------------------------------------------------ text
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(obj, param: str = "") -> None:
    """400 naming the field when any string of a request (a pydantic model, dicts, lists) holds a lone surrogate
    (JSON's "\\ud800" escape decodes to one; it is not a character, and no tokenizer can encode it)."""
    if isinstance(obj, str):
        m = _SURROGATE.search(obj)
        if m:
            raise APIError(400, f"{param or 'the request'} holds a lone surrogate (U+{ord(m.group()):04X}) at "
                                f"character {m.start()}: not valid Unicode text", param=param or None,
                           code="invalid_text")
        return
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__pydantic_fields_set__"):
        items = [*vars(obj).items(), *(getattr(obj, "__pydantic_extra__", None) or {}).items()]
    else:
        return
    for k, v in items:
        check_text(k, param)
        check_text(v, f"{param}.{k}" if param else str(k))


# ------------------------------------------------------------------------------------------------ context
PREFIX_SLACK_TOKENS = 64    # a prefix cut inside a word may take a few more tokens than that stretch of the whole


class ContextTooLong(Exception):
    def __init__(self, at_least: int, how: str):
        super().__init__(how)
        self.at_least, self.how = at_least, how


def max_piece_chars(tokenizer, vocab_size: int) -> int:
    """The most characters one token stands for: a text of C characters has at least C / this many tokens."""
    return max((len(tokenizer.piece(i)) for i in range(vocab_size)), default=1) or 1


def encode_within(encode, text: str, limit: int, piece_chars: int | None, final=None):
    """`encode(text)`, unless the text has more than `limit` tokens; then ContextTooLong, after tokenizing no more
    than about four times what the limit takes. First the characters: C characters need at least C / piece_chars
    tokens, so most of an oversized text is never tokenized. Then prefixes of doubling length: a prefix cut at a
    space tokenizes like that stretch of the whole, so a prefix over the limit (plus a slack) proves the whole
    is. `final(text)` (default `encode`) is what encodes the whole once it is known to fit, and what is returned."""
    n_chars = len(text)
    if piece_chars and n_chars > limit * piece_chars:
        raise ContextTooLong(-(-n_chars // piece_chars), f"{n_chars:,} characters, and one token stands for at "
                                                         f"most {piece_chars}")
    span = 4 * limit            # a text this short costs no more to tokenize than a full context does
    while span < n_chars:
        cut = text.rfind(" ", span // 2, span)
        cut = cut if cut > 0 else span
        n = len(encode(text[:cut]))
        if n > limit + PREFIX_SLACK_TOKENS:
            raise ContextTooLong(n - PREFIX_SLACK_TOKENS, f"its first {cut:,} characters alone are {n:,} tokens")
        span *= 2
    return (final or encode)(text)


def context_error(limit: int, e: ContextTooLong, param: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, the prompt has at least "
                         f"{e.at_least} tokens ({e.how}). Shorten the prompt.", param=param,
                    code="context_length_exceeded", n_ctx=limit)
