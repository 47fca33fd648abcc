"""Serving the application: uvicorn on a thread of its own, the batcher on the main thread.

Why the batcher runs on the main thread: the model's kernels then run on the OpenMP team that loading the
model started, and measured faster there than from a second thread (~25% on a 2-core AMD EPYC for GPT-2's
decoding steps). uvicorn serves from its own thread and event loop; the main thread takes the signals.

The socket is bound beforehand, so that a port in use is one line before anything starts and `port 0` a
free port the caller can name. A signal (Ctrl-C, SIGTERM) stops the server: no new connection is taken,
requests in flight get `grace_s` seconds to finish and are then cancelled, the batcher stops, and `run`
returns (a stop asked for is a clean exit); a second signal stops waiting for what is in flight.
"""

from __future__ import annotations

import contextvars
import signal
import socket
import threading
from types import FrameType
from typing import Any

import uvicorn

from ..generation.batching import ContinuousBatcher


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (OSError when it cannot)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(2048)
    return sock


def run(app: Any, sock: socket.socket, batcher: ContinuousBatcher, *, grace_s: int = 3) -> None:
    """Serve `app` on `sock` while `batcher` decodes on this thread, until a signal stops both (no log of
    uvicorn's: the caller says its own)."""
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False,
                                           timeout_graceful_shutdown=grace_s, lifespan="on"))

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
        server.should_exit = True
        http.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
