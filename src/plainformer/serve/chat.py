"""Chat messages as the prompt a model continues.

A model whose tokenizer came with a `chat_template` (a Hugging Face directory's, kept through training
and checkpoints) renders the messages with it, as transformers' `apply_chat_template` does: jinja2 in an
immutable sandbox, trim_blocks and lstrip_blocks, the tokenizer's bos_token and eos_token,
`add_generation_prompt=True`, a `raise_exception(message)` the template may call and a `tojson`
filter. Any other model gets the plain template, the form Shakespeare's dialogue takes in the bundled
corpus, each message as "ROLE:" on a line of its own and its content below, then the assistant's turn:

    USER:
    How fares the king?

    ASSISTANT:

A model's template is its author's code, and the sandbox bounds what it may touch, not how long it runs
or how much it builds. The server compiles and renders it with `TemplateRenderer`: in a process of its
own (`template_worker.py`) with capped memory, killed past timeout_s, its output stopped past max_chars;
past a bound the request is refused with a 400 naming the template, and the loop, /health and a SIGTERM
never wait for it. A template that does not compile (its syntax) is refused when the server starts.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..data.tokenizers import Tokenizer
from .protocol import APIError
from .template_worker import TemplateError, environment, render

PLAIN_TEMPLATE = ("{% for message in messages %}{{ message.role | upper }}:\n{{ message.content }}\n\n{% endfor %}"
                  "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
TIMEOUT_S = 5.0  # a real template renders in milliseconds
MAX_CHARS = 8 << 20  # twice the largest request body: more than any context holds
MEMORY_BYTES = 512 << 20  # the worker's address space: an interpreter, jinja2 and MAX_CHARS of text fit
WORKER = Path(__file__).with_name("template_worker.py")

__all__ = ["PLAIN_TEMPLATE", "TemplateError", "TemplateRenderer", "chat_prompt"]


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> str:
    """The text a model continues to answer `messages` (see the module docstring), rendered in this
    process with no bound of time or memory: for a template one trusts."""
    template = _compiled(tokenizer.chat_template or PLAIN_TEMPLATE)
    return _text(render(template, _context(tokenizer, messages), MAX_CHARS, 0), "the model's chat template")


class TemplateRenderer:
    """The prompts of `tokenizer`'s chat, served as model `name`: its chat_template rendered in a worker
    process, one render at a time, each bounded (see the module docstring); without a template, the plain
    one in this process, off the event loop. `start` compiles the template (a ValueError saying why it
    cannot be), `close` ends the worker."""

    def __init__(self, tokenizer: Tokenizer, name: str, *, timeout_s: float = TIMEOUT_S, max_chars: int = MAX_CHARS,
                 memory: int = MEMORY_BYTES):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.tokenizer, self.source = tokenizer, tokenizer.chat_template
        self.what = f"the chat template of {name!r}"
        self.timeout_s, self.max_chars, self.memory = timeout_s, max_chars, memory
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the worker renders one request at a time
        self._turn = asyncio.Lock()  # and the requests wait for it on the loop, holding no thread

    def start(self) -> None:
        """Start the worker and compile the template in it; a ValueError saying (in words that follow "the
        template") why it cannot compile."""
        if self.source is None:
            return
        reply = self._render({"template": self.source})
        if "syntax" in reply:
            raise ValueError(f"has a syntax error: {reply['syntax']}")
        if "compiled" not in reply:
            raise ValueError(f"could not compile: {_bound(reply) if 'failed' not in reply else reply['failed']}")

    async def prompt(self, messages: list[dict[str, str]]) -> str:
        if self.source is None:
            return await asyncio.to_thread(chat_prompt, self.tokenizer, messages)
        request = {"template": self.source, "context": _context(self.tokenizer, messages), "max_chars": self.max_chars}
        async with self._turn:
            try:
                reply = await asyncio.to_thread(self._render, request)
            except asyncio.CancelledError:  # the server stops: the thread waiting for the worker returns now
                self._kill()
                raise
        return _text(reply, self.what)

    def close(self) -> None:
        self._kill()

    def _render(self, request: dict[str, Any]) -> dict[str, Any]:
        """The worker's answer, or {"timeout"} (the worker is then killed) or {"failed"} if it died."""
        with self._lock:
            worker = self._worker()
            assert worker.stdin is not None and worker.stdout is not None
            deadline = time.monotonic() + self.timeout_s
            try:
                worker.stdin.write(json.dumps(request).encode() + b"\n")  # ASCII: lone surrogates escaped
                line = _read_line(worker.stdout.fileno(), deadline)
            except OSError:  # the worker is gone (killed by close)
                line = b""
            if line:
                return dict(json.loads(line))
            self._kill()
            worker.stdin.close()
            worker.stdout.close()
            self._process = None
            if time.monotonic() >= deadline:
                return {"timeout": self.timeout_s}
            return {"failed": "its worker process ended while rendering"}

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-I", str(WORKER), str(self.memory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, bufsize=0, start_new_session=True)  # Ctrl-C reaches the server only
        return self._process

    def _kill(self) -> None:
        """Kill the worker (from any thread: the one rendering then reads its end at once)."""
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()


def _read_line(fd: int, deadline: float) -> bytes:
    """One line from `fd`, or b"" when it ends or `deadline` passes first."""
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return b""
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        line += chunk
    return line


def _context(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> dict[str, Any]:
    special = {f"{role}_token": tokenizer.special_tokens.get(role, "") for role in ("bos", "eos")}
    return {"messages": messages, "add_generation_prompt": True, **special}


def _text(reply: dict[str, Any], what: str) -> str:
    """The rendered text of a worker's `reply`, or the APIError it stands for."""
    if "text" in reply:
        return str(reply["text"])
    if "refused" in reply:
        raise APIError(f"{what} refused the messages: {reply['refused']}", param="messages")
    if "failed" in reply or "syntax" in reply:  # the template's own fault, not the client's
        raise APIError(f"{what} failed: {reply.get('failed') or reply['syntax']}", status=500, type="server_error")
    raise APIError(f"{what} {_bound(reply)} rendering these messages: the request is refused", param="messages",
                   code="chat_template_limit")


def _bound(reply: dict[str, Any]) -> str:
    """The bound a worker's reply says was passed."""
    if "timeout" in reply:
        return f"did not finish within {reply['timeout']:g} s"
    if "too_long" in reply:
        return f"rendered more than {reply['too_long']} characters"
    return f"needed more than {reply['memory'] >> 20} MiB of memory"


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    return environment().from_string(source)
