"""The HTTP application (FastAPI): OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`,
and `/health`.

Handlers only read, check and format: the requests' decoding runs on the batcher's thread
(`service.Service`), so the event loop answers `/health` while a batch decodes. Every error, expected
or not, is answered in OpenAI's error shape; a traceback goes to stderr, never to a client. With an API
key, every `/v1` route wants `Authorization: Bearer KEY` (compared in constant time). A body over
max_body bytes is refused with 413 before it is read further. A stream is Server-Sent Events, one
`data: {chunk}` per token of a choice, ending in `data: [DONE]`; a client that goes away, streaming or
not, has its rows freed at the batcher's next step.
"""

from __future__ import annotations

import asyncio
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

from .chat import chat_prompt
from .choices import Choice, chat_logprobs, legacy_logprobs
from .protocol import APIError, ChatRequest, CompletionRequest, parse_chat, parse_completion, parse_json
from .service import Exchange, Service

MAX_BODY_BYTES = 4 << 20


def create_app(service: Service, *, api_key: str | None = None, max_body: int = MAX_BODY_BYTES,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The application serving `service`, whose batcher the caller runs (`server.run`); `on_ready` is
    called once the application has started."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="plainformer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    authorize = _authorizer(api_key)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": service.name, "active_rows": service.batcher.active_rows}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [service.model_card()]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        parsed = parse_completion(parse_json(await _body(request, max_body)), service.batcher.max_rows)
        service.check_model(parsed.decoding.model)
        params = ["prompt" if len(parsed.prompts) == 1 else f"prompt[{i}]" for i in range(len(parsed.prompts))]
        prompts = [service.encode(prompt, param) for prompt, param in zip(parsed.prompts, params, strict=True)]
        exchange = Exchange(service, prompts, parsed.decoding, logprobs=parsed.logprobs, echo=parsed.echo,
                            params=params)
        return await _answer(request, exchange, _Completions(service, exchange, parsed))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        parsed = parse_chat(parse_json(await _body(request, max_body)), service.batcher.max_rows)
        service.check_model(parsed.decoding.model)
        text = chat_prompt(service.tokenizer, parsed.messages)
        try:
            ids = service.tokenizer.encode_text(text)
        except ValueError as error:  # a character the vocabulary lacks
            raise APIError(f"messages: {error}", param="messages") from None
        if not ids:
            raise APIError("messages render to an empty prompt", param="messages")
        exchange = Exchange(service, [ids], parsed.decoding, logprobs=parsed.top_logprobs, params=["messages"])
        return await _answer(request, exchange, _Chat(service, exchange, parsed))

    return app


# ---------------------------------------------------------------------------- the shape of each endpoint


class _Completions:
    """The legacy endpoint's objects: text choices, legacy logprobs, echo."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, service: Service, exchange: Exchange, request: CompletionRequest):
        self.tokenizer, self.exchange, self.request = service.tokenizer, exchange, request

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


async def _answer(request: Request, exchange: Exchange, shape: _Shape) -> Response:
    """Submit the exchange's jobs, then answer with the whole response or its stream."""
    exchange.submit()
    header = {"id": f"{shape.prefix}-{secrets.token_hex(12)}", "created": int(time.time()),
              "model": exchange.service.name}
    if exchange.decoding.stream:
        return StreamingResponse(_stream(exchange, shape, header), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_cancel_on_disconnect(request, exchange))
    try:
        async for _ in exchange.updates():
            pass
    finally:
        watcher.cancel()
        exchange.cancel()
    return JSONResponse({**header, "object": shape.object, "choices": [shape.choice(c) for c in exchange.choices],
                         "usage": exchange.usage()})


async def _cancel_on_disconnect(request: Request, exchange: Exchange) -> None:
    """Free the exchange's rows when the client goes away before its answer."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    exchange.cancel()


async def _stream(exchange: Exchange, shape: _Shape, header: dict[str, Any]) -> AsyncIterator[str]:
    """The SSE events of a stream; the rows are freed when it ends, however it ends (a client that
    disconnects cancels this generator)."""
    usage = exchange.decoding.include_usage

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {**header, "object": shape.chunk_object, "choices": choices, **extra}
        if usage and "usage" not in extra:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    try:
        opened: set[int] = set()
        for choice in exchange.choices:
            if opening := from_opening(choice, shape, opened, event):
                yield opening
            if exchange.settled(choice):  # max_tokens 0 and nothing to score: the choice is whole already
                yield event([shape.delta(choice)])
        async for choice in exchange.updates():
            if opening := from_opening(choice, shape, opened, event):
                yield opening
            if choice.tokens or choice.finish is not None:
                yield event([shape.delta(choice)])
        if usage:
            yield event([], usage=exchange.usage())
    except APIError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        exchange.cancel()
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
    """The request's body, or a 413 as soon as it is known to exceed `limit` bytes."""
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

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        traceback.print_exception(error, file=sys.stderr)
        return JSONResponse(APIError("the server failed to answer this request", status=500,
                                     type="server_error").body(), status_code=500)
