"""One process per run directory: an exclusive `flock` on `DIR/.lock`, which holds the owner's pid.
The same lock, waited for instead of refused, serialises the processes that fill one cache entry.

The kernel drops the lock when its file descriptor closes, so it is released on every exit path of
the owner, including `kill -9`, and never has to be cleaned up. The file itself stays: deleting it
would let a second process lock a fresh file while a third still holds the old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirectoryBusy(OSError):
    """Another process owns the run directory."""

    def __str__(self) -> str:
        return self.args[0]


@contextlib.contextmanager
def run_lock(directory: str | os.PathLike, *, wait: bool = False) -> Iterator[Path]:
    """Own `directory` (created if missing) for the duration of the block.

    Raises RunDirectoryBusy, naming the owner's pid, when another process holds it; with `wait`,
    blocks until the owner lets go instead.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryBusy(f"{directory} is in use by another run (pid {_owner(fd)}); wait for "
                                   "it to finish or stop it, or choose another output directory") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        os.close(fd)  # releases the lock


def _owner(fd: int) -> str:
    """The pid the owner wrote; "unknown" in the instant between its lock and its write."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"
