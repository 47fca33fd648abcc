"""Serving the application: uvicorn on a thread of its own, the batcher on the main thread.

Why the batcher runs on the main thread: the model's kernels then run on the OpenMP team that loading the
model started, and measured faster there than from a second thread (docs/performance.md, "Choices inside
the code"). uvicorn serves from its own thread and event loop; the main thread takes the signals.

The socket is bound beforehand, so that a port in use is one line before anything starts and `port 0` a
free port the caller can name.

No client holds the server (`limits.Connections`): a connection's request must bring its headers within
header_timeout and its body within body_timeout, and an idle connection is closed after keep_alive
seconds; past max_connections open, a new connection is answered 503 and closed. An error that can repeat
thousands of times a second (accept() out of files, a refused connection, a malformed request) is
logged the first time and then as a count every REPEATS_S seconds (`Repeats`), never as a traceback.

A signal (Ctrl-C, SIGTERM) stops the server: no new connection is taken, requests in flight get `grace_s`
seconds to finish (a second signal ends the wait), then the batcher stops and each request still waiting
or decoding ends with an error (a stream with an error event, then `data: [DONE]`), what remains (a
body still arriving, a template rendering) is cancelled with a 503, and `run` returns: a stop asked for
is a clean exit, with no traceback.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import signal
import socket
import threading
import traceback
from collections.abc import Callable
from http import HTTPStatus
from types import FrameType
from typing import Any, Protocol

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..log import log
from .limits import Connections
from .protocol import APIError

REPEATS_S = 10  # how often a repeated error's count is logged
ABORT_S = 5  # how long the batcher may take to finish its step once asked to stop
SETTLE_S = 1  # how long requests get to answer once the batcher has stopped, before they are cancelled
LINGER_S = 1  # how long a refused connection is read (and dropped) so that its client reads the 503


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (OSError when it cannot)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(2048)
    return sock


class Repeats:
    """Lines that may come thousands of times a second: each is logged the first time, then (`flush`,
    every REPEATS_S seconds and at the end) with the number of times it came again."""

    def __init__(self, say: Callable[[str], None] = log):
        self.say = say
        self._again: dict[str, int] = {}  # line -> times it came again since it was logged

    def __call__(self, line: str) -> None:
        if line in self._again:
            self._again[line] += 1
        else:
            self._again[line] = 0
            self.say(line)

    def flush(self) -> None:
        for line, again in self._again.items():
            if again:
                self.say(f"{line} (again {again} times)")
        self._again.clear()


class Runner(Protocol):
    """What runs on the main thread while the application serves: the batcher, or `Idle`."""

    def run(self) -> None: ...

    def stop(self) -> None: ...


class Idle:
    """The main thread's work for a server that only embeds (its requests run on the application's
    threads): waiting for the stop."""

    def __init__(self) -> None:
        self._stopped = threading.Event()

    def run(self) -> None:
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()


def run(app: Any, sock: socket.socket, batcher: Runner, *, grace_s: float = 3,
        connections: Connections | None = None) -> None:
    """Serve `app` on `sock` while `batcher` decodes on this thread, until a signal stops both (no log of
    uvicorn's but its warnings, through `Repeats`: the caller says its own)."""
    connections = connections or Connections()
    repeats = Repeats()
    protocol = type("Connection", (_Connection,), {"limits": connections, "repeats": repeats})
    config = uvicorn.Config(app, http=protocol, ws="none", lifespan="on", log_config=None, access_log=False,
                            timeout_keep_alive=connections.keep_alive)  # type: ignore[arg-type]  # seconds
    stopped = threading.Event()  # the batcher has ended every job it held
    server = _Server(config, abort=batcher.stop, stopped=stopped.is_set, grace_s=grace_s, repeats=repeats)
    uvicorn_log = logging.getLogger("uvicorn.error")
    handler = _RepeatsHandler(repeats)
    uvicorn_log.addHandler(handler)
    uvicorn_log.propagate = False

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            batcher.stop()  # what was in flight has finished or been cancelled by now

    def stop(sig: int, frame: FrameType | None) -> None:
        server.force_exit = server.should_exit
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    # in this thread's context: what it set (`--max-memory`'s limit) holds for the requests' checks too
    http = threading.Thread(target=contextvars.copy_context().run, args=(serve_http,), name="plainformer-http")
    http.start()
    try:
        batcher.run()
    finally:
        stopped.set()
        server.should_exit = True
        http.join()
        for sig, handler_ in previous.items():
            signal.signal(sig, handler_)
        uvicorn_log.removeHandler(handler)
        uvicorn_log.propagate = True


class _Server(uvicorn.Server):
    """uvicorn's server, with the stop the module docstring describes and errors logged through `Repeats`."""

    def __init__(self, config: uvicorn.Config, *, abort: Callable[[], None], stopped: Callable[[], bool],
                 grace_s: float, repeats: Repeats):
        super().__init__(config)
        self.abort, self.stopped, self.grace_s, self.repeats = abort, stopped, grace_s, repeats

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        if counter % (REPEATS_S * 10) == 0:  # a tick is 0.1 s
            self.repeats.flush()
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle ones close now, the others once their response is sent
        await self._until(lambda: self.force_exit, self.grace_s)
        self.abort()
        await self._until(self.stopped, ABORT_S)  # each job it held has been told
        await self._until(lambda: False, SETTLE_S)  # and has answered
        for task in self.server_state.tasks:
            task.cancel()  # what waits for a body or a template
        await self._until(lambda: False, SETTLE_S)
        self.repeats.flush()
        await self.lifespan.shutdown()

    async def _until(self, done: Callable[[], bool], timeout: float) -> None:
        """Wait until no request runs, `done()`, or `timeout` has passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.server_state.tasks and not done() and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The loop's errors: an OS error (accept() out of files) is one line through `Repeats`; anything
        else, a bug, keeps asyncio's report with its traceback."""
        error = context.get("exception")
        if isinstance(error, OSError):
            self.repeats(f"plainformer serve: {context.get('message', 'error')}: {error}")
        elif self.should_exit and isinstance(error, ValueError) and str(error) == "Invalid file descriptor: -1":
            pass  # asyncio retrying accept() (one retry per failure, a second on) on the socket this stop closed
        else:
            loop.default_exception_handler(context)


class _RepeatsHandler(logging.Handler):
    """uvicorn's warnings and errors as lines through `Repeats`; a traceback only where one came with them."""

    def __init__(self, repeats: Repeats):
        super().__init__(logging.WARNING)
        self.repeats = repeats

    def emit(self, record: logging.LogRecord) -> None:
        self.repeats(f"plainformer serve: {record.getMessage()}")
        if record.exc_info and record.exc_info[1] is not None:
            traceback.print_exception(record.exc_info[1])


class _Connection(H11Protocol):
    """uvicorn's HTTP/1.1 connection, with `Connections`' limits: the headers of a request, then its body,
    must arrive within their timeouts (else a 408 if the client sent anything, and the connection closes;
    an application waiting for the body sees the client leave), and a connection beyond max_connections
    is answered 503 and closed (once its client has closed, or after LINGER_S: closing on unread data
    would reset the connection before the client reads the answer)."""

    limits: Connections
    repeats: Repeats
    _stage: str | None = None  # what the client is expected to send: "headers", "body" or nothing
    _timer: asyncio.TimerHandle | None = None
    _heard = False  # whether the client sent anything
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.limits.max_connections
        if len(self.connections) > limit:
            self._refused = True
            self.repeats(f"plainformer serve: refused a connection: {limit} are open (--max-connections {limit})")
            transport.write(_response(503, APIError(f"the server holds {limit} connections, its limit: retry shortly",
                                                    status=503, type="server_error", code="too_many_connections"),
                                      "Retry-After: 1\r\n"))
            transport.write_eof()  # the client reads the answer, then the end; its own end closes this one
            self.loop.call_later(LINGER_S, transport.close)
            return
        self._expect("headers")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._heard = True
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY:  # a pipelined request, read from what was buffered
            self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        super().connection_lost(exc)

    def _follow(self) -> None:
        state = self.conn.their_state
        self._expect("headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

    def _expect(self, stage: str | None) -> None:
        if stage == self._stage:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stage = stage
        if stage is not None:
            self._timer = self.loop.call_later(self._timeout(stage), self._expire)

    def _timeout(self, stage: str) -> float:
        return self.limits.header_timeout if stage == "headers" else self.limits.body_timeout

    def _expire(self) -> None:
        stage, self._stage, self._timer = self._stage, None, None
        if stage is None or self.transport.is_closing():
            return
        cycle = self.cycle
        answered = stage == "body" and cycle is not None and cycle.response_started  # a 413 before the body's end
        if cycle is not None and not cycle.response_complete:  # the application waits for the body
            cycle.disconnected = True
            cycle.message_event.set()
        if self._heard and not answered:
            self.transport.write(_response(408, APIError(f"the request's {stage} did not arrive within "
                                                         f"{self._timeout(stage):g} s", status=408,
                                                         code="request_timeout")))
        self.transport.close()


def _response(status: int, error: APIError, headers: str = "") -> bytes:
    """A whole HTTP response carrying `error`, after which the connection closes."""
    body = json.dumps(error.body()).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n").encode() + body
