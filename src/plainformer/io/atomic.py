"""Atomic writes: a reader sees the old file or the new one, never half of one; and a full disk
reported as one line saying where, not as a library's traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError

# The Rust side of safetensors reports the OS error in its message only.
_FULL_DISK_MESSAGES = ("No space left on device", "Disk quota exceeded")


class DiskFullError(OSError):
    """Writing `path` failed because its file system is full (ENOSPC) or over quota (EDQUOT)."""

    def __init__(self, path: str | os.PathLike, what: str):
        super().__init__(errno.ENOSPC, f"the disk is full: could not write {what} {path}; "
                                       f"free space on the file system of {Path(path).parent} and retry")
        self.filename = None  # already in the message; OSError would append it once more

    def __str__(self) -> str:
        return self.strerror or ""


def is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, SafetensorError) and any(m in str(error) for m in _FULL_DISK_MESSAGES)


@contextlib.contextmanager
def reporting_full_disk(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn a full-disk error raised inside the block into a `DiskFullError` naming `what` and `path`."""
    try:
        yield
    except (OSError, SafetensorError) as error:
        if isinstance(error, DiskFullError) or not is_disk_full(error):
            raise
        raise DiskFullError(path, what) from None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary path beside `path`: write a file or fill a directory there, and on success
    it replaces `path` in one rename, so a reader never sees a half-written result."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        if tmp.is_file() and path.is_dir():  # else os.replace names the temporary file, not `path`
            raise IsADirectoryError(errno.EISDIR, "a directory is in the way of the file to write", str(path))
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()
