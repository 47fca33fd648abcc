"""Serving the application on a socket bound beforehand, with uvicorn.

Binding first makes a port in use one line before anything starts, and `port 0` a free port that the
caller can name. A signal (Ctrl-C, SIGTERM) stops the server: no new connection is taken, requests in
flight get `grace_s` seconds and are then cancelled, and `run` returns (uvicorn would raise the signal
again after its shutdown; a stop asked for is a clean exit here).
"""

from __future__ import annotations

import socket
from types import FrameType
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.force_exit = self.should_exit  # a second Ctrl-C stops waiting for what is in flight
        self.should_exit = True


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (OSError when it cannot)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(2048)
    return sock


def run(app: Any, sock: socket.socket, *, grace_s: int = 3) -> None:
    """Serve `app` on `sock` until a signal stops it (logs: none of uvicorn's; the caller says its own)."""
    config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=grace_s,
                            lifespan="on")
    _Server(config).run(sockets=[sock])
