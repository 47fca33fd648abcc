"""The requests of OpenAI's HTTP API, read from their JSON: `/v1/completions` (the legacy API that
lm-evaluation-harness scores models through), `/v1/chat/completions` and `/v1/embeddings`; and
llama.cpp's `/tokenize` and `/detokenize`.

Every field is checked once, here, and a wrong one is answered with OpenAI's error object naming it:
{"error": {"message", "type", "param", "code"}}. Fields this server does not know are ignored, as
OpenAI-compatible servers do; fields it knows but cannot honour (penalties, tools) are
refused unless they hold their neutral value. Token ids are checked against the vocabulary by the
service, which knows it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from .._checks import is_finite_number, is_int, is_mass, is_non_negative_int, is_positive_int, is_seed

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint
MAX_LEGACY_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 4
MAX_LOGIT_BIAS = 100  # |bias| at most, as OpenAI's
EMBEDDING_FORMATS = ("float", "base64")
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SHUTTING_DOWN = "the server is shutting down: this request was ended before it finished"


class APIError(Exception):
    """An answer in OpenAI's error shape with an HTTP status (400 unless said). The message may quote
    what the client sent: a lone surrogate in it (JSON's "\\ud800") is written as its escape, since
    UTF-8 cannot carry it."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Decoding:
    """What both endpoints ask of the decoding: max_tokens None = up to the context's end."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float | None
    top_k: int | None
    n: int
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """prompts: texts or lists of token ids (each answered with n choices); logprobs: the top-k
    alternatives of each token (0 = the token's own only); echo: the prompt comes back before the text."""

    decoding: Decoding
    prompts: list[str | list[int]]
    logprobs: int | None
    echo: bool


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """messages: [{"role", "content": str}]; top_logprobs: None unless logprobs were asked for."""

    decoding: Decoding
    messages: list[dict[str, str]]
    top_logprobs: int | None


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    """inputs: texts or lists of token ids, one embedding each; encoding_format: "float" (a JSON array) or
    "base64" (the little-endian float32 bytes); dimensions: the leading components kept (None: all)."""

    model: str
    inputs: list[str | list[int]]
    encoding_format: str
    dimensions: int | None


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    """llama.cpp's /tokenize: add_special puts the tokenizer's special tokens around the text ([CLS] .. [SEP],
    a BOS); with_pieces answers each id with its text."""

    content: str
    add_special: bool
    with_pieces: bool


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise APIError(f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_completion(body: dict[str, Any], max_n: int, max_prompts: int | None = None) -> CompletionRequest:
    """max_n: the most choices per prompt; max_prompts: the most prompts (None: any number)."""
    _refuse_unsupported(body, {"suffix": None, "best_of": (None, body.get("n", 1))})
    logprobs = _optional(body, "logprobs", lambda v: is_int(v) and 0 <= v <= MAX_LEGACY_LOGPROBS,
                         f"an integer from 0 to {MAX_LEGACY_LOGPROBS}")
    return CompletionRequest(_decoding(body, max_n, COMPLETION_DEFAULT_MAX_TOKENS), _prompts(body, max_prompts),
                             logprobs, _flag(body, "echo"))


def parse_chat(body: dict[str, Any], max_n: int) -> ChatRequest:
    _refuse_unsupported(body, {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
                               "response_format": (None, {"type": "text"})})
    logprobs = _flag(body, "logprobs")
    top = _optional(body, "top_logprobs", lambda v: is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
                    f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    if top is not None and not logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    if "max_completion_tokens" in body:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    return ChatRequest(_decoding(body, max_n, None), _messages(body), (top or 0) if logprobs else None)


def parse_embeddings(body: dict[str, Any], max_inputs: int = MAX_EMBEDDING_INPUTS) -> EmbeddingRequest:
    """input: a string, a list of strings, a list of token ids, or a list of such lists (at most max_inputs)."""
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError("model must be a string naming the model (GET /v1/models lists it)", param="model")
    inputs = _prompts(body, max_inputs, name="input")
    if "" in inputs:  # OpenAI refuses it too: an embedding of nothing
        raise APIError("input must not hold an empty string", param="input")
    encoding = _optional(body, "encoding_format", lambda v: isinstance(v, str) and v in EMBEDDING_FORMATS,
                         " or ".join(map(repr, EMBEDDING_FORMATS)), default="float")
    dimensions = _optional(body, "dimensions", is_positive_int, "an integer >= 1")
    return EmbeddingRequest(model, inputs, encoding, dimensions)


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    content = body.get("content")
    if not isinstance(content, str):
        raise APIError("content must be the string to tokenize", param="content")
    return TokenizeRequest(content, _flag(body, "add_special"), _flag(body, "with_pieces"))


def parse_detokenize(body: dict[str, Any]) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise APIError("tokens must be a list of token ids", param="tokens")
    return tokens


# ---------------------------------------------------------------------------- fields


def _optional(body: dict[str, Any], name: str, accept: Callable[[Any], bool], expected: str,
              default: Any = None) -> Any:
    """body[name] if `accept`ed (of its type and range: `_checks`' ranges, most); `default` when absent or
    null; else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not accept(value):
        raise APIError(f"{name} must be {expected}, got {json.dumps(value)[:80]}", param=name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    return _optional(body, name, lambda v: isinstance(v, bool), "true or false", default=False)


def _refuse_unsupported(body: dict[str, Any], neutral: dict[str, Any]) -> None:
    """A 400 for a field this server cannot honour, unless it holds a neutral value (or one of them)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise APIError(f"{name} is not supported by this server (only 0)", param=name)
    for name, allowed in neutral.items():
        values = allowed if isinstance(allowed, tuple) else (allowed,)
        if name in body and body[name] not in values:
            raise APIError(f"{name} is not supported by this server", param=name)


def _decoding(body: dict[str, Any], max_n: int, default_max_tokens: int | None) -> Decoding:
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError("model must be a string naming the model (GET /v1/models lists it)", param="model")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise APIError("stream_options is only allowed with stream: true", param="stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError("stream_options must be an object such as {\"include_usage\": true}", param="stream_options")
    include_usage = _optional(options or {}, "include_usage", lambda v: isinstance(v, bool),
                              "true or false", default=False)
    return Decoding(
        model=model,
        max_tokens=_optional(body, "max_tokens", is_non_negative_int, "an integer >= 0",
                             default=default_max_tokens),
        temperature=_optional(body, "temperature", lambda v: is_finite_number(v) and 0 <= v <= 2,
                              "a number from 0 to 2", default=1.0),
        top_p=_optional(body, "top_p", is_mass, "a number in (0, 1]"),
        top_k=_optional(body, "top_k", lambda v: is_int(v) and (v >= 1 or v == -1), "an integer >= 1 (-1: no limit)"),
        n=_optional(body, "n", lambda v: is_int(v) and 1 <= v <= max_n, f"an integer from 1 to {max_n} (--max-batch)",
                    default=1),
        stop=_stop(body.get("stop")),
        seed=_optional(body, "seed", is_seed, "an integer in [0, 2**64)"),
        stream=stream,
        include_usage=include_usage,
        logit_bias=_logit_bias(body.get("logit_bias")),
    )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{"token id": bias}, each bias in [-100, 100] -> ((id, bias), ...) in the ids' order."""
    if value is None:
        return ()
    expected = (f"logit_bias must map token ids (as strings, \"50256\") to numbers from -{MAX_LOGIT_BIAS} to "
                f"{MAX_LOGIT_BIAS}")
    if not isinstance(value, dict):
        raise APIError(f"{expected}, got {json.dumps(value)[:80]}", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or not is_finite_number(bias) or not abs(bias) <= MAX_LOGIT_BIAS:
            raise APIError(f"{expected}, got {json.dumps({key: bias})[:80]}", param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if (not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise APIError(f"stop must be a non-empty string or a list of 1 to {MAX_STOP_STRINGS} of them", param="stop")
    return tuple(stops)


def _prompts(body: dict[str, Any], max_prompts: int | None, name: str = "prompt") -> list[str | list[int]]:
    """body[name] (prompt, or the embeddings' input): a string, a list of strings, a list of token ids, or a
    list of such lists (at most max_prompts of them)."""
    prompt = body.get(name)
    expected = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(f"{name} must be {expected} (not empty)", param=name)
    if all(is_int(t) for t in prompt):
        return [prompt]
    if max_prompts is not None and len(prompt) > max_prompts:
        raise APIError(f"{name} holds {len(prompt)} items; this server takes at most {max_prompts} in one request"
                       f"{' (--max-queue)' if name == 'prompt' else ''}", param=name)
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
        return list(prompt)
    raise APIError(f"{name} must be {expected}, each list not empty", param=name)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    return [_message(i, message) for i, message in enumerate(messages)]


def _message(i: int, message: Any) -> dict[str, str]:
    """messages[i] with its content as one string (a list of text parts joined)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise APIError(f"{where} must be an object whose role is one of {', '.join(CHAT_ROLES)}", param=where)
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(part["text"] for part in content)
    if content is None and message["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise APIError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    return {"role": message["role"], "content": content}
