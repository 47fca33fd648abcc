"""A model directory's sha256: a checkpoint's through its manifest, any other through every visible file."""

from __future__ import annotations

import hashlib

from plainformer.files.digest import directory_sha256, sha256_file


def test_a_file_digest_is_hashlibs(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 3_000_000)  # more than one read
    assert sha256_file(path) == hashlib.sha256(b"x" * 3_000_000).hexdigest()


def test_any_change_of_name_or_content_changes_a_directorys_digest_and_hidden_files_do_not(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 10)
    first = directory_sha256(tmp_path)
    (tmp_path / ".lock").write_text("pid")
    assert directory_sha256(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 9 + b"\1")
    changed = directory_sha256(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")
    assert len({first, changed, directory_sha256(tmp_path)}) == 3


def test_a_checkpoints_digest_is_its_manifests(tmp_path):
    (tmp_path / "manifest.json").write_text('{"files": {}}')
    (tmp_path / "model.safetensors").write_bytes(b"ignored: the manifest records its sha256")
    assert directory_sha256(tmp_path) == sha256_file(tmp_path / "manifest.json")
