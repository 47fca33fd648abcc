"""Fixtures shared by several test folders."""

from __future__ import annotations

import os
import subprocess

import pytest

# why: nothing is downloaded at run time; set before any test module imports huggingface_hub (which reads it
# once) and inherited by every process a test starts, so that no test can wait on a network CI lacks
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _tmpfs(tmp_path, options: str):
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root and CAP_SYS_ADMIN; the monkeypatched variant runs anyway")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB file system of its own, where the test runs as root and may mount one."""
    yield from _tmpfs(tmp_path, "size=256k")


@pytest.fixture
def read_only_tmpfs(tmp_path):
    """A read-only file system of its own (root ignores a folder's permission bits, not this)."""
    yield from _tmpfs(tmp_path, "ro,size=64k")


def pytest_configure(config):
    # why: pytest-xdist's workers share the machine's cores; one intra-op thread each keeps two
    # workers on two cores from oversubscribing them (OpenMP threads spin while they wait)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture
def environ(monkeypatch):
    """Sets torchrun's variables for the test (none set before it)."""
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)

    def set_launch(rank: int, world_size: int, local_rank: int) -> None:
        for name, value in zip(TORCHRUN, (rank, world_size, local_rank), strict=True):
            monkeypatch.setenv(name, str(value))

    return set_launch
