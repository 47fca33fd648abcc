"""Fixtures shared by several test folders."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB file system of its own, where the test runs as root and may mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root and CAP_SYS_ADMIN; the monkeypatched variant runs anyway")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
