"""Atomic writes of a file or a directory: a reader sees the old one or the new one, never half of one;
and a full disk reported as one line saying where, not as a library's traceback.

Every temporary has one name scheme, `.{name}.tmp-{pid}-{random}` beside the path it becomes (the name
shortened where the whole would pass the file system's 255 bytes), so one sweep
(`remove_stale_temporaries`) can tell whose it is and whether its writer is still alive; each write first
sweeps the temporaries that killed writers of the same path left. A directory replaces an existing one in
two renames (the old one first to `.{name}.old`, deleted once the new one is in place), so a crash at any
instant leaves a complete copy at one of the two names; `surviving` says which.

What a write may replace: nothing, a regular file (by a file) or a directory (by a directory). A symbolic
link is followed: the file or directory it names is replaced and the link stays. Anything else at the
path (a device, a FIFO, a socket) is refused with `NotReplaceableError` before a byte is written, so that
no rename ever turns `/dev/full` or a pipe into a regular file.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import stat
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from safetensors import SafetensorError

# The Rust side of safetensors reports the OS error in its message only.
_FULL_DISK_MESSAGES = ("No space left on device", "Disk quota exceeded")
_TMP_INFIX = ".tmp-"
_NAME_MAX = 255  # bytes in one file name: Linux's NAME_MAX, and that of macOS and Windows' file systems
_TMP_SUFFIX_BYTES = len(_TMP_INFIX) + 10 + 1 + 12  # ".tmp-", a pid up to 2**32, "-", 12 hex digits


class DiskFullError(OSError):
    """Writing `path` failed because its file system is full (ENOSPC) or over quota (EDQUOT)."""

    def __init__(self, path: str | os.PathLike, what: str):
        super().__init__(errno.ENOSPC, f"the disk is full: could not write {what} {path}; "
                                       f"free space on the file system of {Path(path).parent} and retry")
        self.filename = None  # already in the message; OSError would append it once more

    def __str__(self) -> str:
        return self.strerror or ""


class WriteError(OSError):
    """Writing `path` failed for another reason than a full disk (a read-only or missing folder)."""

    def __init__(self, error: OSError, path: str | os.PathLike):
        super().__init__(error.errno, f"cannot write {path}: {error.strerror}")

    def __str__(self) -> str:
        return self.strerror or ""


class NotReplaceableError(OSError):
    """A write would replace something that is neither a regular file nor a directory (a device, a FIFO,
    a socket), or a file by a directory or a directory by a file."""

    def __init__(self, path: str | os.PathLike, what: str, rule: str = "only a regular file or a directory is "
                                                                         "replaced"):
        super().__init__(errno.EEXIST, f"{path} is {what}: {rule}; choose another path")

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
        if not is_disk_full(error):
            raise
        raise DiskFullError(path, what) from None  # also over an inner one: this block knows the whole


def temporary_name(path: Path) -> Path:
    """A fresh temporary beside `path`, named after it (shortened to fit one file name) and this process."""
    return path.with_name(f"{_temporary_prefix(path.name)}{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _temporary_prefix(name: str) -> str:
    """`.{name}.tmp-`, with `name` cut (at a character) so that a whole temporary's name fits _NAME_MAX bytes."""
    room = _NAME_MAX - 1 - _TMP_SUFFIX_BYTES
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) > room:
        name = encoded[:room].decode("utf-8", "ignore")
    return f".{name}{_TMP_INFIX}"


def writable_target(path: str | os.PathLike) -> Path:
    """The path a write at `path` replaces: `path`, or what a symbolic link there names.
    NotReplaceableError when something else than nothing, a regular file or a directory is there."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return path
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return path
    raise NotReplaceableError(path, _kind(mode))


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "neither a regular file nor a directory")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary path beside `path`: write a file or fill a directory there, and on success
    it replaces `path` in one rename, so a reader never sees a half-written result. What `path` may be,
    and how a symbolic link there is followed, is the module's rule; the temporaries a killed writer of
    `path` left are removed first."""
    path = writable_target(path)
    _remove_stale_temporaries_of(path)
    tmp = temporary_name(path)
    try:
        yield tmp
        _check_replaceable(tmp, path)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as error:
        raise _about(error, tmp, path) from None
    finally:
        if tmp.exists():
            _remove(tmp)


def write_files(directory: Path, files: Mapping[str, str | bytes]) -> None:
    """Write each of `files` (name -> text, as UTF-8, or bytes) into `directory`, each atomically."""
    for name, content in files.items():
        with atomic_path(directory / name) as tmp:
            if isinstance(content, bytes):
                tmp.write_bytes(content)
            else:
                tmp.write_text(content, encoding="utf-8")


def _check_replaceable(tmp: Path, path: Path) -> None:
    """Refuse a rename of `tmp` onto `path` that would replace a thing of another kind (found again now:
    what was there at the start of the write may have changed)."""
    if tmp.is_file() and path.is_dir():  # else os.replace names the temporary file, not `path`
        raise IsADirectoryError(errno.EISDIR, "a directory is in the way of the file to write", str(path))
    writable_target(path)
    if tmp.is_dir() and path.exists() and not path.is_dir():
        raise NotReplaceableError(path, "a regular file", "a directory cannot replace it")


def _about(error: OSError | SafetensorError, tmp: Path, path: Path) -> Exception:
    """`error` as the user should read it: about `path`, not the temporary written in its place (a
    read-only folder, a full disk)."""
    if isinstance(error, DiskFullError):
        return error
    if is_disk_full(error):
        return DiskFullError(path, "the file")
    if isinstance(error, OSError) and error.filename is not None and Path(error.filename) == tmp:
        return WriteError(error, path)
    return error


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary directory beside `target`, to fill: on success its files are fsynced and it
    replaces `target` (which may exist) with a complete copy on disk at every instant; on failure it
    is removed and `target` is untouched. Stale temporaries of killed writers are swept first."""
    target = writable_target(target)
    if target.exists() and not target.is_dir():
        raise NotReplaceableError(target, "a regular file", "a directory cannot replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target.parent, target.name)
    tmp = temporary_name(target)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def old_copy(target: Path) -> Path:
    """Where `atomic_directory` keeps the previous `target` between its two renames."""
    return target.parent / f".{target.name}.old"


def surviving(target: str | os.PathLike) -> Path | None:
    """`target`, or, when it is gone, the previous copy that a write interrupted between its two renames
    left at `.{name}.old`; None when neither is a directory."""
    target = Path(target)
    old = old_copy(target)
    if not target.exists() and old.is_dir():
        return old
    return target if target.is_dir() else None


def remove_stale_temporaries(folder: str | os.PathLike, name: str | None = None) -> None:
    """Delete the temporaries in `folder` that writers killed mid-way left: those whose process is gone,
    and those of `name` from before pids were in the name."""
    for path in Path(folder).glob(f".*{_TMP_INFIX}*"):
        if _is_stale(path) or (name is not None and _is_pidless_of(path, name)):
            _remove(path)


def _remove_stale_temporaries_of(path: Path) -> None:
    """Delete the temporaries of `path` alone whose writers were killed (an export's 100 MB weights)."""
    prefix = _temporary_prefix(path.name)
    if path.parent.is_dir():
        for temporary in path.parent.glob(f"{glob.escape(prefix)}*"):
            if _is_stale(temporary):
                _remove(temporary)


def _is_stale(temporary: Path) -> bool:
    """A temporary named after a pid that runs no more, or after this process's own: a killed writer's pid
    comes back soon in a container, and this process writes one temporary of a path at a time."""
    owner = temporary.name.rpartition(_TMP_INFIX)[2].partition("-")[0]
    return owner.isdigit() and (int(owner) == os.getpid() or not _process_alive(int(owner)))


def _is_pidless_of(temporary: Path, name: str) -> bool:
    """A temporary of `name` from before pids were in the name."""
    owner = temporary.name.rpartition(_TMP_INFIX)[2].partition("-")[0]
    return not owner.isdigit() and temporary.name.startswith(f".{name}{_TMP_INFIX}")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or a number no pid reaches
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`, keeping a complete copy on disk at every instant."""
    old = old_copy(target)
    if target.exists():
        # A leftover `old` next to an existing target is a finished swap's debris; the target is whole.
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
