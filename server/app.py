"""The OpenAI-compatible HTTP API (FastAPI), running in the launcher's process. Generation happens in the compute
process; this side renders prompts, queues requests (`WorkerClient`), turns tokens into text and SSE chunks,
and counts. See docs/serving.md for the API surface."""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from procs import messages as m
from server import errors, limits, openapi, request_options
from server.metrics import log as request_log, request_line, setup_logging
from server.tool_calls import CallsInContent, messages_for_template
from server.errors import APIError
from server.metrics import Metrics
from server.protocol import ImagePart, TextPart
from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.tokenizer import TextStream, Tokenizer
from server.worker_client import QueueFull, WorkerClient, WorkerUnavailable


@dataclass
class ServerSettings:
    model_name: str
    model_dir: str                      # where config.json, tokenizer and generation config are read
    max_model_len: int | None = None    # None: the config's max_position_embeddings
    api_key: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)    # defaults under each request's own
    retry_after_s: int = 5
    allow_image_urls: bool = False      # fetch http(s) image URLs (--allow-image-urls); data URLs always work
    allow_private_image_urls: bool = False   # ... also from loopback / private / link-local hosts
    max_image_pixels: int = 50_000_000  # larger images are a 400 (--max-image-pixels)
    max_body_bytes: int | None = None   # larger request bodies are a 413 (--max-body-mb); None: fits the context
    store_dir: str | None = None        # the expert store (named in the log when a block is damaged)
    max_tokens_default: int = 2048      # a request without max_tokens gets at most this many (--max-tokens-default)
    log_level: str = "info"
    created: int = field(default_factory=lambda: int(time.time()))


class ServerState:
    def __init__(self, settings: ServerSettings, client: WorkerClient):
        self.settings, self.client = settings, client
        self.tokenizer: Tokenizer | None = None
        self.piece_chars: int | None = None      # the most characters one token stands for
        self.draining = False
        self.store_damaged: str | None = None     # why the expert store cannot serve a block (then /health 503)
        self.loading: str | None = None     # the launcher's phase before the compute process: "repacking (n %)"
        self.metrics = Metrics(client)
        cfg = _read_json(Path(settings.model_dir) / "config.json")
        gen = _read_json(Path(settings.model_dir) / "generation_config.json")
        # An Omni / VL checkpoint nests the language model's config; its vision tower makes images possible.
        self.vision_config = cfg if cfg.get("vision_config") else None
        cfg = cfg.get("llm_config") or cfg.get("text_config") or cfg if self.vision_config else cfg
        self.image_geometry = None
        if self.vision_config is not None:
            from nemotron import vision_preprocess as vp
            self.image_geometry = vp.ImageGeometry.from_model_dir(settings.model_dir)
        self.vocab_size = int(cfg.get("vocab_size", 0))
        max_pos = int(cfg.get("max_position_embeddings") or 0) or 1 << 20
        self.max_model_len = min(settings.max_model_len or max_pos, max_pos)
        self.sampling_defaults = m.SamplingParams.model_defaults(gen)

    def load_tokenizer(self) -> None:
        tok = Tokenizer(self.settings.model_dir)
        self.piece_chars = limits.max_piece_chars(tok, self.vocab_size)
        self.metrics.watch_prompt_memo(tok.stretches)
        self.tokenizer = tok

    def mark_store_damaged(self, why: str) -> None:
        if self.store_damaged is None:
            s = self.settings
            print(f"server: the expert store is damaged: {why}\nserver: check every block with `python -m "
                  f"tools.repack --verify {s.store_dir or 'STORE'} --model {s.model_dir}`", file=sys.stderr,
                  flush=True)
        self.store_damaged = why

    @property
    def max_body_bytes(self) -> int:
        return self.settings.max_body_bytes or limits.default_max_body_bytes(self.max_model_len)

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None and self.client.state == "ready" and not self.draining


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------------ app
def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moestream", version="0.1.0",
                  description="OpenAI-compatible API of moestream (NemotronH MoE with experts streamed from NVMe)")
    app.state.ms = state
    setup_logging(state.settings.log_level)
    plain_openapi = app.openapi
    app.openapi = lambda: openapi.drop_unused_422(plain_openapi())
    app.add_exception_handler(RequestValidationError, errors.validation_error)
    app.add_exception_handler(StarletteHTTPException, errors.http_error)
    app.add_exception_handler(APIError, errors.api_error)
    app.add_exception_handler(Exception, errors.unexpected_error)
    app.add_middleware(limits.BodyLimit, max_bytes=lambda: state.max_body_bytes,
                       on_reject=lambda path: state.metrics.failed(path, "request_too_large"))

    async def check_key(request: Request) -> None:
        # async: FastAPI runs a plain `def` dependency in its thread pool, a hop per request (~0.2-0.4 ms here)
        key = state.settings.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(check_key)]

    @app.get("/health", responses=openapi.HEALTH)
    async def health():
        if state.ready and state.store_damaged is None:
            return {"status": "ok"}
        c = state.client
        if state.store_damaged is not None and c.state == "ready" and not state.draining:
            msg = (f"the expert store is damaged: {state.store_damaged}. Requests that route to this block fail; "
                   "`python -m tools.repack --verify STORE --model MODEL` checks every block (the server's log "
                   "names STORE and MODEL); repack or restore the store, then restart")
        elif c.state == "failed" or (c.fatal and c.state in ("stopping", "stopped")):
            msg = f"the compute process failed: {c.fatal}"        # the reason, also while the launcher exits
        elif state.draining or c.state in ("stopping", "stopped"):
            msg = "shutting down"
        elif c.state == "restarting":
            msg = "the compute process is restarting"
        elif state.loading and state.loading.startswith("repacking"):
            msg = state.loading                     # "repacking (n %)": the store is being made, once
        else:
            msg = f"loading ({c.status})" if c.status else "loading"
        return JSONResponse({"status": "unavailable", "error": {"code": 503, "message": errors.without_paths(msg),
                                                                 "type": "unavailable_error"}},
                            status_code=503, headers={"Retry-After": str(state.settings.retry_after_s)})

    @app.get("/metrics", responses=openapi.METRICS, response_class=Response)
    async def metrics():
        return Response(await state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth, response_model=None,
             responses={200: {"model": openapi.ModelList}, **openapi.errors(401)})
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth, response_model=None,
             responses={200: {"model": openapi.ModelCard}, **openapi.errors(401, 404)})
    async def model(model_id: str):
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/tokenize", dependencies=auth, response_model=None,
              responses={200: {"model": openapi.Tokens}, **openapi.errors(400, 401, 404, 413, 503)})
    async def tokenize(req: TokenizeRequest):
        tok = _tokenizer(state)
        limits.check_text(req)
        _check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            ids, _, _ = await asyncio.to_thread(_chat_ids, state, req.messages, req.chat_template_kwargs, req.tools,
                                                req.add_generation_prompt)    # it may fetch image URLs
        else:
            encode = lambda text: tok.encode(text, add_special_tokens=req.add_special_tokens)    # noqa: E731
            try:        # bounded like a prompt: a text far over the context is refused, not tokenized whole
                ids = await asyncio.to_thread(limits.encode_within, encode, req.prompt, state.max_model_len,
                                              state.piece_chars)
            except limits.ContextTooLong as e:
                raise limits.context_error(state.max_model_len, e, "prompt")
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=auth, response_model=None,
              responses={200: {"model": openapi.Text}, **openapi.errors(400, 401, 404, 413, 503)})
    async def detokenize(req: DetokenizeRequest):
        tok = _tokenizer(state)
        limits.check_text(req)
        _check_model(state, req.model)
        _check_ids(state, req.tokens, "tokens")
        return {"prompt": tok.decode(req.tokens)}

    @app.post("/v1/chat/completions", dependencies=auth, response_model=None,
              responses=openapi.generation(openapi.ChatCompletion))
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        tok = _tokenizer(state)
        limits.check_text(req)
        _check_model(state, req.model)
        _check_unsupported(req)
        ids, keep_at, images = await asyncio.to_thread(_chat_ids, state, req.messages, req.chat_template_kwargs,
                                                       req.tools, True, bool(req.cache_prompt))
        in_reasoning = tok.starts_in_reasoning(ids)
        if req.tools or req.response_format is not None:     # compiles a schema check: off the event loop
            tools = await asyncio.to_thread(request_options.chat_tools, req, in_reasoning)
        else:                                                # nothing to compile: no thread hop
            tools = request_options.chat_tools(req, in_reasoning)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        gen = _Gen(state, "chat", req, ids, max_tokens, keep_at=keep_at, images=images,
                   logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                   reasoning=True, in_reasoning=in_reasoning, tools=tools)
        return await gen.respond(request)

    @app.post("/v1/completions", dependencies=auth, response_model=None,
              responses=openapi.generation(openapi.Completion))
    async def completions(req: CompletionRequest, request: Request):
        tok = _tokenizer(state)
        limits.check_text(req)
        _check_model(state, req.model)
        _check_unsupported(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (list, str)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request (batched prompts are not supported)", param="prompt")
            p = p[0]
        if isinstance(p, str):
            try:
                ids = await asyncio.to_thread(limits.encode_within, tok.encode, p, state.max_model_len,
                                              state.piece_chars)
            except limits.ContextTooLong as e:
                raise limits.context_error(state.max_model_len, e, "prompt")
            prompt_text = p
        else:
            ids = list(p)
            _check_ids(state, ids, "prompt")
            prompt_text = tok.decode(ids)
        gen = _Gen(state, "completion", req, ids, req.max_tokens, logprobs=req.logprobs,
                   echo=prompt_text if req.echo else None)
        return await gen.respond(request)

    return app


def _tokenizer(state: ServerState) -> Tokenizer:
    c = state.client
    if c.fatal and c.state in ("failed", "stopping", "stopped"):
        raise APIError(503, f"the compute process failed: {c.fatal}", code="compute_process_failed")
    if state.draining or state.client.state in ("stopping", "stopped"):
        raise APIError(503, "the server is shutting down", headers={"Retry-After": str(state.settings.retry_after_s)})
    if state.tokenizer is None or state.client.state == "loading":
        raise APIError(503, "the model is loading", headers={"Retry-After": str(state.settings.retry_after_s)})
    return state.tokenizer


def _model_card(state: ServerState) -> dict:
    s = state.settings
    return {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "moestream",
            "root": s.model_name, "max_model_len": state.max_model_len,     # not model_dir: no server paths
            "max_tokens_default": s.max_tokens_default,
            # what a request that sets no chat_template_kwargs gets (the demo: thinking off, so the text of a
            # random-weight model arrives as content, not as reasoning_content)
            "default_chat_template_kwargs": dict(s.chat_template_kwargs)}


def _check_model(state: ServerState, name: str | None) -> None:
    if name and name != state.settings.model_name:
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{state.settings.model_name}`).",
                       param="model", code="model_not_found")


def _check_ids(state: ServerState, ids: list[int], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of range [0, {state.vocab_size})", param=param)


def _check_unsupported(req) -> None:
    request_options.refuse_unsupported(req)


def _chat_ids(state: ServerState, messages, template_kwargs, tools, add_generation_prompt: bool,
              messages_end: bool = False):
    """The prompt's token ids and, with `messages_end`, where to keep a snapshot: the end of the last message,
    before the generation prompt (the next turn renders the assistant's turn differently, e.g. with its thinking
    removed, so only the text up to there is certain to come back token for token)."""
    from server import images as im
    tok = state.tokenizer
    msgs, encoded = [], []
    for message in messages:
        d = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            urls = [p.url for p in message.content if isinstance(p, ImagePart)]
            if not urls:
                d["content"] = "".join(p.text for p in message.content)
            else:
                if state.vision_config is None:
                    raise APIError(400, f"this model ({state.settings.model_name}) has no vision tower: image "
                                        "inputs are not supported", param="messages", code="invalid_image")
                # the template renders each image part as <image>, in order
                d["content"] = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else
                                {"type": "image_url", "image_url": {"url": ""}} for p in message.content]
                encoded += [im.fetch(u, state.settings.allow_image_urls, state.settings.allow_private_image_urls)
                            for u in urls]
        if d.get("role") == "developer":
            d["role"] = "system"
        msgs.append(d)
    msgs = messages_for_template(msgs)
    from nemotron.vision_preprocess import IMAGE_TOKEN
    from nemotron.vision_prompt import ImageTokenError, PromptImages, encode_prompt, image_token_id
    prompt_images = images = None
    if encoded:
        geom = state.image_geometry
        pv, grid, digests = im.preprocess([im.decode(b, state.settings.max_image_pixels) for b in encoded], geom)
        prompt_images = PromptImages(grid, grid.grids_per_image, geom, image_token_id(state.vision_config))
    template_kwargs = {**state.settings.chat_template_kwargs, **(template_kwargs or {})}
    try:
        within = lambda text: limits.encode_within(tok.encode, text, state.max_model_len,   # noqa: E731
                                                   state.piece_chars)
        # where the last message ends is asked only when a snapshot may be kept there (cache_prompt)
        split = lambda text, n: limits.encode_within(tok.encode, text, state.max_model_len,   # noqa: E731
                                                     state.piece_chars, final=lambda t: tok.encode_split(t, n))
        prompt = encode_prompt(lambda gen: tok.render_chat(msgs, gen, tools, template_kwargs), within,
                               prompt_images, add_generation_prompt, messages_end=messages_end, encode_split=split)
    except ImageTokenError as e:
        raise APIError(400, f"{e} (does a text part contain a literal {IMAGE_TOKEN}?)", param="messages",
                       code="invalid_image")
    except APIError:
        raise
    except limits.ContextTooLong as e:
        raise limits.context_error(state.max_model_len, e, "messages")
    except Exception as e:
        raise APIError(400, f"the chat template could not render these messages: {type(e).__name__}: {e}",
                       param="messages")
    if encoded:
        images = im.ImageInputs(pv, grid, prompt.image_positions, digests)
    return prompt.ids, [prompt.messages_end] if prompt.messages_end is not None else [], images


# ------------------------------------------------------------------------------------------------ one generation
class _Gen:
    def __init__(self, state: ServerState, kind: str, req, ids: list[int], max_tokens, keep_at=(), logprobs=None,
                 reasoning: bool = False, in_reasoning: bool = False, echo: str | None = None, images=None,
                 tools: request_options.ChatTools | None = None):
        self.state, self.kind, self.req, self.ids = state, kind, req, ids
        self.tools = tools
        self.calls = CallsInContent(tools.tools, tools.parallel) if tools is not None and tools.parse else None
        self.images = images
        self.tok = state.tokenizer
        self.logprobs = logprobs
        self.echo = echo
        self.t0 = time.monotonic()
        self.rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        n, limit = len(ids), state.max_model_len
        if n == 0:
            raise APIError(400, "the prompt is empty", param="prompt" if kind == "completion" else "messages")
        if n >= limit or (max_tokens is not None and n + max_tokens > limit):
            want = "" if max_tokens is None else f" and {max_tokens} output tokens were requested"
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, the prompt has "
                                f"{n} tokens{want}. Shorten the prompt or lower max_tokens.",
                           param="messages" if kind == "chat" else "prompt", code="context_length_exceeded",
                           n_prompt_tokens=n, n_ctx=limit)
        # no max_tokens: a bounded default, not the rest of the context (a near-endless request at a few tok/s)
        self.max_tokens = max_tokens if max_tokens is not None else min(limit - n, state.settings.max_tokens_default)
        stops = [] if req.ignore_eos else list(self.tok.eos_ids)
        stops += [int(t) for t in (req.stop_token_ids or [])]
        # the API's own readings of some fields (top_k -1 is off, min_tokens at most max_tokens, stop tokens
        # are the eos ids plus the request's, logit_bias checked against the vocabulary); every other sampling
        # field is taken by name
        self.params = m.SamplingParams.for_request(
            {**{k: getattr(req, k) for k in type(req).model_fields}, "top_k": None if req.top_k is None else max(req.top_k, 0), "max_tokens": self.max_tokens,
             "min_tokens": min(req.min_tokens, self.max_tokens), "stop_token_ids": sorted(set(stops)),
             "logit_bias": request_options.logit_bias(req, state.vocab_size)},
            state.sampling_defaults)
        self.stop_strings = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.text = TextStream(self.tok, self.stop_strings, reasoning=reasoning, in_reasoning=in_reasoning,
                               literal_tokens=self.tok.tool_call_marks if self.calls is not None else ())
        self.keep_at = list(keep_at)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.tokens: list[int] = []
        self.finish = None
        self.cached = 0
        self.timings: m.Timings | None = None
        self.engine: m.EngineTotals | None = None     # the engine's figures of this request (the done message)
        self.job = None

    # ---- talking to the worker ------------------------------------------------------------------
    def submit(self) -> None:
        msg = m.Generate(id="", prompt_ids=self.ids, params=self.params, logprobs=self.logprobs,
                         keep_at=self.keep_at, use_snapshots=bool(self.req.cache_prompt),
                         images=self.images.message() if self.images is not None else None,
                         grammar=m.Grammar(**self.tools.grammar) if self.tools is not None and
                         self.tools.grammar is not None else None)
        try:
            self.job = self.state.client.submit(msg)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; retry later",
                           headers={"Retry-After": str(self.state.settings.retry_after_s)}, code="queue_full")
        except WorkerUnavailable as e:
            raise APIError(503, str(e), headers={"Retry-After": str(self.state.settings.retry_after_s)})

    async def events(self):
        """Yields (text deltas, logprob entries) per token; ends with self.finish set. Raises APIError on failure."""
        client = self.state.client
        job = self.job
        stopped_by_text = False
        try:
            while True:
                ev = await job.events.get()
                if isinstance(ev, m.Started):
                    self.cached = ev.cached_tokens
                elif isinstance(ev, m.Token):
                    if stopped_by_text:
                        continue
                    t = ev.token
                    self.tokens.append(t)
                    is_eos = ev.finish_reason == "stop" and t in self.params.stop_token_ids
                    deltas = {"reasoning": "", "content": ""} if is_eos else self.text.push(t)
                    lps = None
                    if self.logprobs is not None and not is_eos and ev.logprob is not None:
                        lps = [(t, ev.logprob, ev.top_logprobs or [])]
                    if self.text.stopped:
                        stopped_by_text = True
                        client.cancel(job)
                        deltas = self._route(deltas, final=True)
                        self.finish = self._tool_finish("stop")
                    elif ev.finish_reason:
                        tail = self.text.finish()
                        deltas = self._route({k: deltas[k] + tail[k] for k in deltas}, final=True)
                        self.finish = self._tool_finish(ev.finish_reason)
                    else:
                        deltas = self._route(deltas)
                    yield deltas, lps
                elif isinstance(ev, m.Done):
                    self.timings = ev.timings
                    self.engine = ev.engine
                    if self.finish is None:
                        tail = self._route(self.text.finish(), final=True)
                        if tail["reasoning"] or tail["content"] or tail["tool_calls"]:
                            yield tail, None
                        self.finish = "abort" if ev.finish_reason == "cancelled" else ev.finish_reason
                        self.finish = self._tool_finish(self.finish)
                    return
                elif isinstance(ev, m.Error):
                    self.finish = "error"
                    if ev.abort:
                        raise APIError(503, ev.message, code="aborted")
                    if ev.store_damaged:
                        self.state.mark_store_damaged(ev.store_damaged)
                        raise APIError(500, ev.message, code="store_damaged", headers={"x-should-retry": "false"})
                    raise APIError(500, ev.message, code="compute_process_crashed" if ev.crash else
                                   "generation_failed", headers={"x-should-retry": "false"})
        finally:
            if job.state != "finished":
                client.cancel(job)
            self._observe()

    def _route(self, deltas: dict, final: bool = False) -> dict:
        """Content through the tool-call parser when the request has tools; adds 'tool_calls' (delta entries)."""
        if self.calls is None:
            return {**deltas, "tool_calls": []}
        return self.calls.finish(deltas) if final else self.calls.route(deltas)

    def _tool_finish(self, finish: str | None) -> str | None:
        # OpenAI: "tool_calls" when the model called tools (auto / required); a named tool_choice stays "stop"
        if finish == "stop" and self.calls is not None and self.calls.calls and not self.tools.named:
            return "tool_calls"
        return finish

    def _observe(self) -> None:
        finish = self.finish or "cancelled"      # the client left: still a request, counted as such
        t = self.full_timings()
        measured = self.timings is not None      # else the client left before the worker's figures came back
        queue_s = (self.job.started - self.job.enqueued) if self.job and self.job.started else 0.0
        self.state.metrics.observe(self.kind, finish, len(self.ids), self.cached, len(self.tokens), t,
                                   queue_s, time.monotonic() - self.t0, measured=measured)
        e = self.engine
        hits = e.expert_lookup_hits_total if e is not None else 0
        looked = hits + e.expert_lookup_misses_total if e is not None else 0
        request_log.info(request_line(self.rid, self.kind, finish, len(self.ids), self.cached, len(self.tokens),
                                      t["prompt_ms"] / 1e3 if self.tokens and measured else None,
                                      t["predicted_per_second"] if measured else None,
                                      hits / looked if looked else None))

    def usage(self) -> dict:
        u = {"prompt_tokens": len(self.ids), "completion_tokens": len(self.tokens),
             "total_tokens": len(self.ids) + len(self.tokens),
             "prompt_tokens_details": {"cached_tokens": self.cached}}
        if self.kind == "chat":
            u["completion_tokens_details"] = {"reasoning_tokens": self.text.reasoning_tokens}
        return u

    def full_timings(self) -> dict:
        """The response's llama.cpp-style `timings`: the worker's figures and their per-token and per-second
        rates (a request cancelled before it started has no figures: its prompt counts as not computed)."""
        t = self.timings
        if t is None:
            t = m.Timings(cache_n=self.cached, prompt_n=len(self.ids) - self.cached, prompt_ms=0.0,
                          predicted_n=len(self.tokens), predicted_ms=0.0, decode_steps=0)
        pn, pms, dn, dms = t.prompt_n, t.prompt_ms, t.decode_steps, t.predicted_ms
        return {"cache_n": t.cache_n, "prompt_n": pn, "prompt_ms": pms,
                "prompt_per_token_ms": pms / pn if pn else 0.0, "prompt_per_second": 1e3 * pn / pms if pms else 0.0,
                "predicted_n": len(self.tokens), "predicted_ms": dms, "decode_steps": dn,
                "predicted_per_token_ms": dms / dn if dn else 0.0,
                "predicted_per_second": 1e3 * dn / dms if dms else 0.0}

    # ---- shapes ---------------------------------------------------------------------------------
    def _chat_logprobs(self, lps) -> dict | None:
        if lps is None:
            return None
        out = []
        for t, lp, top in lps:
            s = self.tok.piece(t)
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": self.tok.piece(i), "logprob": v,
                                          "bytes": list(self.tok.piece(i).encode())} for i, v in top]})
        return {"content": out}

    def _completion_logprobs(self, lps, offset: int) -> dict | None:
        if lps is None:
            return None
        d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in lps:
            s = self.tok.piece(t)
            d["tokens"].append(s)
            d["token_logprobs"].append(lp)
            d["top_logprobs"].append({self.tok.piece(i): v for i, v in top})
            d["text_offset"].append(offset)
            offset += len(s)
        return d

    def _chunk(self, choice: dict | None, **extra) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return "data: " + json.dumps({"id": self.rid, "object": obj, "created": self.created,
                                      "model": self.state.settings.model_name,
                                      "choices": [] if choice is None else [choice], **extra}) + "\n\n"

    # ---- responses ------------------------------------------------------------------------------
    async def respond(self, request: Request):
        self.request = request
        self.submit()
        if self.req.stream:
            return StreamingResponse(self.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        task = asyncio.create_task(self.collect())
        watch = asyncio.create_task(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            watch.cancel()
            raise
        if task in done:
            watch.cancel()
            return task.result()
        task.cancel()           # the client left: its generation stops within one token
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return Response(status_code=499)

    async def collect(self):
        reasoning, content, lp_entries, lp_comp = [], [], [], None
        offset = len(self.echo or "")
        async for deltas, lps in self.events():
            reasoning.append(deltas["reasoning"])
            content.append(deltas["content"])
            if lps:
                if self.kind == "chat":
                    lp_entries += self._chat_logprobs(lps)["content"]
                else:
                    d = self._completion_logprobs(lps, offset)
                    offset += sum(len(s) for s in d["tokens"])
                    if lp_comp is None:
                        lp_comp = d
                    else:
                        for k in d:
                            lp_comp[k] += d[k]
        base = {"id": self.rid, "created": self.created, "model": self.state.settings.model_name,
                "usage": self.usage(), "timings": self.full_timings()}
        if self.kind == "chat":
            msg = {"role": "assistant", "content": "".join(content)}
            if self.calls is not None and self.calls.calls:
                msg["tool_calls"] = self.calls.calls
                msg["content"] = msg["content"] or None      # OpenAI: null content beside tool calls
            r = "".join(reasoning)
            if r:
                msg["reasoning_content"] = r
            choice = {"index": 0, "message": msg, "finish_reason": self.finish,
                      "logprobs": {"content": lp_entries} if self.logprobs is not None else None}
        else:
            if self.logprobs is not None and lp_comp is None:
                lp_comp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            choice = {"index": 0, "text": (self.echo or "") + "".join(content), "finish_reason": self.finish,
                      "logprobs": lp_comp}
        if self.req.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = self.ids, self.tokens
        return {**base, "object": "chat.completion" if self.kind == "chat" else "text_completion", "choices": [choice]}

    async def stream(self):
        chat = self.kind == "chat"
        offset = 0
        try:
            if chat:
                yield self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
            elif self.echo:
                yield self._chunk({"index": 0, "text": self.echo, "logprobs": None, "finish_reason": None})
                offset = len(self.echo)
            async for deltas, lps in self.events():
                if chat:
                    delta = {}
                    if deltas["reasoning"]:
                        delta["reasoning_content"] = deltas["reasoning"]
                    if deltas["content"]:
                        delta["content"] = deltas["content"]
                    if deltas["tool_calls"]:
                        delta["tool_calls"] = deltas["tool_calls"]
                    if delta or lps:
                        yield self._chunk({"index": 0, "delta": delta, "logprobs": self._chat_logprobs(lps),
                                           "finish_reason": None})
                else:
                    if deltas["content"] or lps:
                        lp = self._completion_logprobs(lps, offset)
                        offset += len(deltas["content"])
                        yield self._chunk({"index": 0, "text": deltas["content"], "logprobs": lp,
                                           "finish_reason": None})
            last = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish} if chat else
                    {"index": 0, "text": "", "logprobs": None, "finish_reason": self.finish})
            yield self._chunk(last, timings=self.full_timings())
            if self.include_usage:
                yield self._chunk(None, usage=self.usage())
        except APIError as e:
            errors.count_failure(self.request.scope, e.status, e.code)
            yield e.sse()           # the 200 status is gone: the error travels as an event
        yield "data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
