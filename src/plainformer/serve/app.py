"""The HTTP application (FastAPI): OpenAI's `/v1/completions`, `/v1/chat/completions`, `/v1/embeddings` and
`/v1/models`; llama.cpp's `/tokenize` and `/detokenize`; `/health` (GET or HEAD) and `/metrics` (Prometheus's
text format, `metrics.Metrics`).

The event loop only moves bytes: reading a body's JSON, checking its fields, rendering a chat template and
encoding the prompts run on threads (the template in a process of its own, `chat.TemplateRenderer`), and
so does formatting a whole response, so /health answers within milliseconds whatever a request holds. The
requests' decoding runs on the batcher's thread (`service.Service`).

Every error, expected or not, is answered in OpenAI's error shape; a traceback goes to stderr once, and
only for a bug, never to a client. What is expected is quiet: a client that goes away (mid-body, waiting
in the queue, or decoding, streaming or not) frees its handler, its queue place and its rows at once, and
a request the server's stop cuts short is answered 503 (a stream ends with an error event and `data:
[DONE]`). With an API key, every `/v1` route wants `Authorization: Bearer KEY` (compared in constant
time), and so do /tokenize and /detokenize; /health and /metrics, which a load balancer and a scraper
read, want none. A body over max_body bytes is refused with 413 before it is read further. A stream is
Server-Sent Events, one `data: {chunk}` per token of a choice, ending in `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import secrets
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .chat import TemplateRenderer
from .choices import Choice, chat_logprobs, legacy_logprobs
from .metrics import Metrics
from .protocol import (
    SHUTTING_DOWN,
    APIError,
    ChatRequest,
    CompletionRequest,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_embeddings,
    parse_json,
    parse_tokenize,
)
from .service import Exchange, Service

MAX_BODY_BYTES = 4 << 20


def create_app(service: Service, *, api_key: str | None = None, max_body: int = MAX_BODY_BYTES,
               renderer: TemplateRenderer | None = None, on_ready: Callable[[], None] | None = None) -> Guarded:
    """The application serving `service`, whose batcher the caller runs (`server.run`); `renderer` renders
    its chat prompts (default: the model's template with the default bounds), and `on_ready` is called once
    the application has started."""
    prompts = renderer or TemplateRenderer(service.tokenizer, service.name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            prompts.close()

    app = FastAPI(title="plainformer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    authorize = _authorizer(api_key)
    metrics = Metrics(service.batcher)
    guarded = Guarded(app, metrics)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, Any]:
        batcher = service.batcher
        return {"status": "ok", "model": service.name, "active_rows": batcher.active_rows if batcher else 0,
                "queued": batcher.queued if batcher else 0, "requests": guarded.requests}

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(metrics.render(), media_type=Metrics.content_type)

    async def answered(request: Request, answer: Callable[[Any], dict[str, Any]]) -> Response:
        """answer(the request's JSON body), worked out and formatted off the event loop."""
        authorize(request)
        raw = await _body(request, max_body)
        return Response(await asyncio.to_thread(lambda: _json(answer(parse_json(raw)))), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await answered(request, lambda body: service.tokenize(parse_tokenize(body)))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await answered(request, lambda body: service.detokenize(parse_detokenize(body)))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        authorize(request)
        raw = await _body(request, max_body)
        body, tokens = await asyncio.to_thread(_embeddings, service, raw)
        metrics.tokens(tokens)
        return Response(body, media_type="application/json")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [service.model_card()]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        raw = await _body(request, max_body)
        exchange, shape = await asyncio.to_thread(_completion, service, raw, asyncio.get_running_loop())
        return await _answer(request, exchange, shape, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        raw = await _body(request, max_body)
        parsed = await asyncio.to_thread(_chat_request, service, raw)
        text = await prompts.prompt(parsed.messages)
        exchange, shape = await asyncio.to_thread(_chat, service, parsed, text, asyncio.get_running_loop())
        return await _answer(request, exchange, shape, metrics)

    return guarded


class Guarded:
    """The application as the server runs it: what escapes the application is a bug, whose 500 has been
    sent (FastAPI's handler) and whose traceback is logged here, once; a request the server's stop
    cancels is answered 503 if nothing was sent yet, without a traceback. `requests`: the /v1 requests
    in flight. Each request is counted in `metrics` by its route and status once answered, and its
    arrival (time.perf_counter()) is `request.state.arrived`."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics, self.requests = app, metrics, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrived = time.perf_counter()
        scope.setdefault("state", {})["arrived"] = arrived
        status = 500  # what a client that is sent nothing at all is counted as

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        counted = scope["path"].startswith("/v1/")
        self.requests += counted
        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:  # the server's stop, once its grace has passed
            with contextlib.suppress(RuntimeError):  # what was sent cannot be taken back
                await JSONResponse(APIError(SHUTTING_DOWN, status=503, type="server_error").body(),
                                   status_code=503)(scope, receive, sending)
        except Exception as error:
            traceback.print_exception(error, file=sys.stderr)
        finally:
            self.requests -= counted
            self.metrics.answered(scope["path"], status, time.perf_counter() - arrived)


def _completion(service: Service, raw: bytes, loop: asyncio.AbstractEventLoop) -> tuple[Exchange, _Completions]:
    """A completion request's exchange, read, checked and encoded (on a thread)."""
    body = parse_json(raw)
    batcher = service.generator()
    parsed = parse_completion(body, batcher.max_rows, batcher.max_queue)
    service.check_model(parsed.decoding.model)
    params = ["prompt" if len(parsed.prompts) == 1 else f"prompt[{i}]" for i in range(len(parsed.prompts))]
    prompts = [service.encode(prompt, param) for prompt, param in zip(parsed.prompts, params, strict=True)]
    exchange = Exchange(service, prompts, parsed.decoding, loop=loop, logprobs=parsed.logprobs, echo=parsed.echo,
                        params=params)
    return exchange, _Completions(service, exchange, parsed)


def _chat_request(service: Service, raw: bytes) -> ChatRequest:
    body = parse_json(raw)
    parsed = parse_chat(body, service.generator().max_rows)
    service.check_model(parsed.decoding.model)
    return parsed


def _chat(service: Service, parsed: ChatRequest, text: str, loop: asyncio.AbstractEventLoop) -> tuple[Exchange, _Chat]:
    """A chat request's exchange, its rendered messages encoded (on a thread)."""
    try:
        ids = service.tokenizer.encode_text(text)
    except ValueError as error:  # a character the vocabulary lacks
        raise APIError(f"messages: {error}", param="messages") from None
    if not ids:
        raise APIError("messages render to an empty prompt", param="messages")
    exchange = Exchange(service, [ids], parsed.decoding, loop=loop, logprobs=parsed.top_logprobs,
                        params=["messages"], logprobs_param="top_logprobs")
    return exchange, _Chat(service, exchange, parsed)


def _embeddings(service: Service, raw: bytes) -> tuple[bytes, int]:
    """An embeddings request's whole answer in OpenAI's shape, and the tokens it read (on a thread)."""
    parsed = parse_embeddings(parse_json(raw))
    service.check_model(parsed.model)
    vectors, tokens = service.embeddings(parsed)
    if parsed.encoding_format == "base64":  # the little-endian float32 bytes, as OpenAI sends them
        data: list[Any] = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        data = vectors.tolist()
    return _json({"object": "list", "model": service.name,
                  "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}), tokens


# ---------------------------------------------------------------------------- the shape of each endpoint


class _Completions:
    """The legacy endpoint's objects: text choices, legacy logprobs, echo."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, service: Service, exchange: Exchange, request: CompletionRequest):
        self.tokenizer, self.exchange, self.request = service.tokenizer, exchange, request
        self.scores_prompt = request.echo and request.logprobs is not None  # an opening worth a thread

    def _echoed(self, choice: Choice) -> str:
        return self.tokenizer.decode(choice.prompt) if self.request.echo else ""

    def choice(self, choice: Choice) -> dict[str, Any]:
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = legacy_logprobs(self.tokenizer, choice.scored_ids(), *choice.scores())
        return {"index": choice.index, "text": self._echoed(choice) + choice.text(self.tokenizer, self.exchange.stop),
                "logprobs": logprobs, "finish_reason": choice.finish}

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        """A stream's first chunk of a choice: the echoed prompt (with its scores when asked)."""
        if not self.request.echo or (self.request.logprobs is not None and choice.prompt_scores is None):
            return None
        logprobs = None
        if self.request.logprobs is not None:
            scores = choice.scores()
            logprobs = legacy_logprobs(self.tokenizer, choice.prompt, scores[0][:len(choice.prompt)],
                                       scores[1][:len(choice.prompt)])
        return {"index": choice.index, "text": self._echoed(choice), "logprobs": logprobs, "finish_reason": None}

    def delta(self, choice: Choice) -> dict[str, Any]:
        """A stream's chunk of a choice's newest token."""
        before = len(self._echoed(choice)) + len(choice.sent)
        text = choice.delta(self.tokenizer, self.exchange.stop)
        logprobs = None
        if self.request.logprobs is not None and choice.tokens:
            logprobs = legacy_logprobs(self.tokenizer, choice.tokens[-1:], choice.logprobs[-1:], choice.top[-1:],
                                       offset=before)
        return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish}


class _Chat:
    """The chat endpoint's objects: assistant messages, chat logprobs."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, service: Service, exchange: Exchange, request: ChatRequest):
        self.tokenizer, self.exchange, self.request = service.tokenizer, exchange, request
        self.scores_prompt = False

    def choice(self, choice: Choice) -> dict[str, Any]:
        logprobs = None
        if self.request.top_logprobs is not None:
            logprobs = chat_logprobs(self.tokenizer, choice.tokens, choice.logprobs, choice.top)
        message = {"role": "assistant", "content": choice.text(self.tokenizer, self.exchange.stop)}
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": choice.finish}

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, choice: Choice) -> dict[str, Any]:
        text = choice.delta(self.tokenizer, self.exchange.stop)
        logprobs = None
        if self.request.top_logprobs is not None and choice.tokens:
            logprobs = chat_logprobs(self.tokenizer, choice.tokens[-1:], choice.logprobs[-1:], choice.top[-1:])
        delta = {"content": text} if text or choice.finish is None else {}
        return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": choice.finish}


_Shape = _Completions | _Chat


async def _answer(request: Request, exchange: Exchange, shape: _Shape, metrics: Metrics) -> Response:
    """Submit the exchange's jobs, then answer with the whole response (formatted on a thread) or its
    stream. A client that goes away first frees its rows and its queue places, and is sent nothing. What
    the exchange read and drew, however it ended, is counted in `metrics`."""
    exchange.submit()
    header = {"id": f"{shape.prefix}-{secrets.token_hex(12)}", "created": int(time.time()),
              "model": exchange.service.name}
    arrived = request.state.arrived
    if exchange.decoding.stream:
        return _Stream(exchange, _stream(exchange, shape, header), lambda: _count(metrics, exchange, arrived))
    try:
        if not await _finished(request, exchange):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    finally:
        exchange.cancel()
        _count(metrics, exchange, arrived)

    def whole() -> bytes:
        return _json({**header, "object": shape.object, "choices": [shape.choice(c) for c in exchange.choices],
                      "usage": exchange.usage()})

    return Response(await asyncio.to_thread(whole), media_type="application/json")


def _count(metrics: Metrics, exchange: Exchange, arrived: float) -> None:
    usage = exchange.usage()
    first = exchange.first_token_at
    metrics.tokens(usage["prompt_tokens"], usage["completion_tokens"], None if first is None else first - arrived)


class _Stream(StreamingResponse):
    """An SSE stream that frees the exchange's rows and queue places however it ends, even before its
    first event (a client that leaves at once), and then calls `ended`."""

    def __init__(self, exchange: Exchange, events: AsyncIterator[str], ended: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                          "X-Accel-Buffering": "no"})
        self.exchange, self.ended = exchange, ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.exchange.cancel()
            self.ended()


async def _finished(request: Request, exchange: Exchange) -> bool:
    """Wait for every choice of the exchange (True), or for its client to go away (False)."""
    async def collect() -> None:
        async for _ in exchange.updates():
            pass

    collecting = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((collecting, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        collecting.cancel()
        gone.cancel()
    if not collecting.done() or collecting.cancelled():
        return False
    collecting.result()  # the batcher's error, if it failed
    return True


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(content: Any) -> bytes:
    """`content` as JSONResponse writes it."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


async def _stream(exchange: Exchange, shape: _Shape, header: dict[str, Any]) -> AsyncIterator[str]:
    """The SSE events of a stream, ending in `data: [DONE]` whether its choices finished or the batcher
    failed or stopped (an error event first). A choice's opening (its echoed prompt, scored) is formatted
    on a thread, its tokens here."""
    usage = exchange.decoding.include_usage

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {**header, "object": shape.chunk_object, "choices": choices, **extra}
        if usage and "usage" not in extra:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    opened: set[int] = set()

    async def opening(choice: Choice) -> str:
        if choice.index in opened or not shape.scores_prompt:
            return from_opening(choice, shape, opened, event)
        return await asyncio.to_thread(from_opening, choice, shape, opened, event)

    try:
        for choice in exchange.choices:
            if first := await opening(choice):
                yield first
            if exchange.settled(choice):  # max_tokens 0 and nothing to score: the choice is whole already
                yield event([shape.delta(choice)])
        async for choice in exchange.updates():
            if first := await opening(choice):
                yield first
            if choice.tokens or choice.finish is not None:
                yield event([shape.delta(choice)])
        if usage:
            yield event([], usage=exchange.usage())
    except APIError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
    yield "data: [DONE]\n\n"


def from_opening(choice: Choice, shape: _Shape, opened: set[int], event: Callable[..., str]) -> str:
    """The choice's opening event the first time it can be sent ("" otherwise)."""
    if choice.index in opened:
        return ""
    opening = shape.opening(choice)
    if opening is None:
        return ""
    opened.add(choice.index)
    return event([opening])


# ---------------------------------------------------------------------------- the edges


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, or a 413 as soon as it is known to exceed `limit` bytes (the server reads the
    rest and drops it, within --timeout-body, so that the client reads the 413, not a reset)."""
    declared = request.headers.get("content-length", "")
    too_large = APIError(f"the request body exceeds {limit} bytes", status=413, code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _authorizer(api_key: str | None) -> Callable[[Request], None]:
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError("a valid API key is needed: send the header Authorization: Bearer KEY", status=401,
                           code="invalid_api_key")
    return authorize


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        message = error.detail if isinstance(error.detail, str) else "the request was refused"
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return JSONResponse(APIError(message, status=error.status_code, code=code).body(),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def gone(_: Request, error: ClientDisconnect) -> Response:
        return Response(status_code=499)  # the client left mid-body: nobody reads this

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:  # its traceback: `Guarded`'s
        return JSONResponse(APIError("the server failed to answer this request", status=500,
                                     type="server_error").body(), status_code=500)
