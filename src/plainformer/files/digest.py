"""sha256 of a file, and of a model directory: what a checkpoint's manifest and a LoRA run's reference
to its base model record."""

from __future__ import annotations

import hashlib
from pathlib import Path

MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def directory_sha256(directory: Path) -> str:
    """One sha256 for a model directory. A plainformer checkpoint: its manifest's, which records the
    sha256 of every other file (and loading checks them against it). Anything else, a Hugging Face
    directory say: the sha256 of each visible file's name and content, in name order."""
    if (directory / MANIFEST).is_file():
        return sha256_file(directory / MANIFEST)
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")):
        digest.update(f"{path.name}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()
