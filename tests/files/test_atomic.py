"""Tests for plainformer.files.atomic: a write replaces the old file in one rename or leaves it alone."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from plainformer.files.atomic import (
    DiskFullError,
    NotReplaceableError,
    WriteError,
    atomic_directory,
    atomic_path,
    temporary_name,
)


def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp != path
        tmp.write_text("new")
        assert path.read_text() == "old"  # readers see the old file until the rename
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_a_directory_in_the_way_of_a_file_is_named_in_the_error(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(IsADirectoryError, match=r"a directory is in the way of the file to write: '.*out'"):
        with atomic_path(tmp_path / "out") as tmp:
            tmp.write_text("png")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_error_on_the_temporary_names_the_path_it_becomes(tmp_path):
    path = tmp_path / "attn.png"
    with pytest.raises(WriteError) as raised, atomic_path(path) as tmp:
        raise PermissionError(13, "Permission denied", str(tmp))  # what a read-only folder gives
    assert str(raised.value) == f"cannot write {path}: Permission denied"


def test_a_read_only_file_system_is_named_by_the_path(read_only_tmpfs):
    path = read_only_tmpfs / "attn.png"
    with pytest.raises(WriteError, match=f"^cannot write {path}: Read-only file system$"), atomic_path(path) as tmp:
        tmp.write_text("png")


def test_a_full_disk_is_named_by_the_path(small_tmpfs):
    path = small_tmpfs / "big.bin"
    with pytest.raises(DiskFullError, match=f"could not write the file {path}; free space"), atomic_path(path) as tmp:
        tmp.write_bytes(bytes(1 << 20))
    assert list(small_tmpfs.iterdir()) == []


def test_a_directory_can_be_written_in_one_rename(tmp_path):
    with atomic_path(tmp_path / "cache") as tmp:
        tmp.mkdir()
        (tmp / "tokens.bin").write_bytes(b"\0" * 4)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tokens.bin"]


@pytest.fixture(params=["fifo", "socket", "character device"])
def special_file(request, tmp_path) -> Path:
    """A FIFO, a bound Unix socket, or a character device like /dev/full (where this process may make one)."""
    path = tmp_path / "special"
    if request.param == "fifo":
        os.mkfifo(path)
    elif request.param == "socket":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        request.addfinalizer(listener.close)
    else:
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # /dev/full's numbers
        except PermissionError:
            pytest.skip("making a device node needs CAP_MKNOD, which this process lacks")
    return path


def test_a_file_write_refuses_a_device_fifo_or_socket_and_leaves_it_as_it_is(special_file):
    kind = stat.S_IFMT(special_file.lstat().st_mode)
    with pytest.raises(NotReplaceableError, match=f"^{special_file} is a .*: only a regular file or a directory is "
                                                  "replaced; choose another path$"):
        with atomic_path(special_file) as tmp:
            pytest.fail(f"a temporary {tmp} was handed out for a target that must be refused")
    assert stat.S_IFMT(special_file.lstat().st_mode) == kind
    assert [p.name for p in special_file.parent.iterdir()] == ["special"]


def test_a_directory_write_refuses_a_device_fifo_or_socket(special_file):
    with pytest.raises(NotReplaceableError), atomic_directory(special_file):
        pytest.fail("a directory was filled for a target that must be refused")
    assert not special_file.is_dir()


def test_a_symbolic_link_is_followed_and_stays_a_link(tmp_path):
    (tmp_path / "real.gguf").write_text("old")
    (tmp_path / "link.gguf").symlink_to("real.gguf")
    with atomic_path(tmp_path / "link.gguf") as tmp:
        tmp.write_text("new")
    assert (tmp_path / "link.gguf").is_symlink() and (tmp_path / "real.gguf").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.gguf", "real.gguf"]


def test_a_symbolic_link_to_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link").symlink_to("pipe")
    with pytest.raises(NotReplaceableError, match="pipe is a FIFO"), atomic_path(tmp_path / "link") as tmp:
        tmp.write_text("data")
    assert (tmp_path / "link").is_symlink() and stat.S_ISFIFO((tmp_path / "pipe").stat().st_mode)


def test_a_checkpoint_written_through_a_link_replaces_the_directory_it_names(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "old.txt").write_text("old")
    (tmp_path / "best").symlink_to("real")
    with atomic_directory(tmp_path / "best") as tmp:
        (tmp / "new.txt").write_text("new")
    assert (tmp_path / "best").is_symlink() and [p.name for p in (tmp_path / "real").iterdir()] == ["new.txt"]


def test_a_directory_write_refuses_a_regular_file_in_its_place(tmp_path):
    (tmp_path / "cache").write_text("a file")
    with pytest.raises(NotReplaceableError, match="cache is a regular file: a directory cannot replace it"):
        with atomic_path(tmp_path / "cache") as tmp:
            tmp.mkdir()
    with pytest.raises(NotReplaceableError), atomic_directory(tmp_path / "cache"):
        pass
    assert (tmp_path / "cache").read_text() == "a file"


def test_a_name_of_250_characters_is_written_though_its_temporary_name_is_longer(tmp_path):
    path = tmp_path / ("a" * 105 + "é" * 70 + ".gguf")  # 2-byte characters where the cut falls, mid-character
    assert len(path.name.encode()) == 250
    with atomic_path(path) as tmp:
        assert len(tmp.name.encode()) <= 255
        tmp.write_text("weights")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def _killed_pid() -> int:
    child = subprocess.Popen(["sleep", "60"])
    child.kill()
    child.wait()
    return child.pid


def test_the_temporaries_a_killed_writer_left_go_at_the_next_write_of_the_same_path(tmp_path):
    path = tmp_path / ("b" * 250)
    dead = _killed_pid()
    left = [temporary_name(path).with_name(temporary_name(path).name.replace(f"-{os.getpid()}-", f"-{dead}-"))
            for _ in range(2)]
    for temporary in left:
        temporary.write_bytes(b"half of a 100 MB export")
    alive = tmp_path / f".other{'.tmp-'}{os.getppid()}-0123456789ab"  # another path's, of a live writer
    alive.write_text("in progress")
    with atomic_path(path) as tmp:
        tmp.write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, alive.name])
