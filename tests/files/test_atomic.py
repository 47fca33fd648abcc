"""Tests for plainformer.files.atomic: a write replaces the old file in one rename or leaves it alone."""

from __future__ import annotations

import pytest

from plainformer.files.atomic import DiskFullError, WriteError, atomic_path


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
