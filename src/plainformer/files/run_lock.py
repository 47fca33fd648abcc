"""One process per run directory: an exclusive `flock` on `DIR/.lock`, which holds the owner's pid.
The same lock, waited for instead of refused, serialises the processes that fill one cache entry.

The kernel drops the lock when its file descriptor closes, so it is released on every exit path of
the owner, including `kill -9`. An owner that leaves through Python (a return, an exception, a signal
turned into one) also removes the file, while it still holds the lock; a process that was waiting on
that file then holds a lock on a file no longer at the path, sees so, and locks the path's new file
instead, so that two processes never own the directory at once. The file of a killed owner stays, and
the next owner takes it over.
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
    """Own `directory` (created if missing) for the duration of the block; the lock file is gone after it.

    Raises RunDirectoryBusy, naming the owner's pid, when another process holds it; with `wait`,
    blocks until the owner lets go instead.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = _lock(path, wait)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        try:
            if _is_at(fd, path):  # not when something else removed it (and maybe put another there)
                path.unlink()
        finally:
            os.close(fd)  # releases the lock


def _lock(path: Path, wait: bool) -> int:
    """A descriptor of the file at `path` (created if missing) that holds its exclusive lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner(fd)
            os.close(fd)
            raise RunDirectoryBusy(f"{path.parent} is in use by another run (pid {owner}); wait for "
                                   "it to finish or stop it, or choose another output directory") from None
        except BaseException:
            os.close(fd)
            raise
        if _is_at(fd, path):
            return fd
        os.close(fd)  # its owner removed it before letting go: the lock to take is the path's new file


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the one at `path` (not removed, nor replaced)."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)


def _owner(fd: int) -> str:
    """The pid the owner wrote; "unknown" in the instant between its lock and its write."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"
