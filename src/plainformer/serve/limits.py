"""What the server holds at once, and for how long: its connections and their timeouts (`Connections`),
and the open files they need (`raise_file_limit`). Free of the serve extra, so that the command line
can show the defaults without it.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import sys

FILES_RESERVED = 64  # open files the process needs beside its connections: the model, pipes, the log


@dataclasses.dataclass(frozen=True)
class Connections:
    """How many connections the server holds, and how long each may take (seconds): to send a request's
    headers (from its first byte, or from the connection's opening), to send its body (from its
    headers' end), and to start the next request (keep_alive)."""

    max_connections: int = 512
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ValueError(f"max_connections must be a positive integer, got {self.max_connections!r}")
        for name in ("header_timeout", "body_timeout", "keep_alive"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def raise_file_limit() -> int:
    """Lift the process's soft limit on open files (RLIMIT_NOFILE) to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # macOS's unlimited hard limit: soft stays as it is
            pass
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return sys.maxsize if soft == resource.RLIM_INFINITY else soft
