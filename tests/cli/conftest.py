"""Fixtures of the command-line tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from plainformer.cli import main
from plainformer.families import resolve as families_resolve


@pytest.fixture(scope="session")
def run(tmp_path_factory) -> Path:
    """The `default` preset (Llama-shaped, char tokenizer) trained 3 steps on the bundled corpus, once for the
    command-line tests a worker runs (they read it; a test that changes a run copies it first)."""
    out = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLAINFORMER_CACHE", str(out / "cache"))
        patch.setattr(families_resolve, "matmul_rate", lambda dtype, seconds: 1e15)  # its 4 x 256 shape on any machine
        assert main(["train", "--preset", "default", "--out", str(out), "--max-steps", "3", "--batch-size", "2",
                     "--eval-batches", "1", "--no-progress"]) == 0
    return out

