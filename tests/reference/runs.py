"""Runs trained here for the tests that need one: `plainformer train` on a small text, in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from plainformer.cli import main


def trained_run(tmp: Path, text: str, *flags: str) -> Path:
    """`plainformer train --data TEXT FLAGS` in tmp/run, with the data cache in tmp/cache."""
    corpus = tmp / "corpus.txt"
    corpus.write_text(text)
    out = tmp / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLAINFORMER_CACHE", str(tmp / "cache"))
        assert main(["train", "--data", str(corpus), "--out", str(out), "--no-progress", *flags]) == 0
    return out
