"""Tests for plainformer.files.run_lock: one owner per run directory, released by the kernel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from plainformer.files import run_lock as run_lock_module
from plainformer.files.run_lock import LOCK_FILE, RunDirectoryBusy, run_lock

HOLD = """
import sys, time
from plainformer.files.run_lock import run_lock
with run_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_second_owner_is_refused_naming_the_first_owners_pid(tmp_path):
    with run_lock(tmp_path / "run"):
        with pytest.raises(RunDirectoryBusy) as info, run_lock(tmp_path / "run"):
            pass
    assert str(info.value) == (f"{tmp_path / 'run'} is in use by another run (pid {os.getpid()}); wait for "
                               "it to finish or stop it, or choose another output directory")
    assert isinstance(info.value, OSError)


def test_the_lock_is_released_and_its_file_removed_on_leaving_the_block_also_by_an_exception(tmp_path):
    with pytest.raises(KeyError), run_lock(tmp_path):
        raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []
    with run_lock(tmp_path) as path:
        assert path == tmp_path / LOCK_FILE and path.read_text() == f"{os.getpid()}\n"
    assert list(tmp_path.iterdir()) == []


def test_a_waiter_on_the_file_its_owner_removed_locks_the_new_file_so_one_process_owns_the_directory(
        tmp_path, monkeypatch):
    """The waiter's flock returns once the owner has removed the file: it must not own the directory
    through the removed file while a newcomer owns it through a new one."""
    waiting, locked, leave = threading.Event(), threading.Event(), threading.Event()
    real_flock = run_lock_module.fcntl.flock

    def flock(fd, operation):
        if threading.current_thread().name == "waiter":
            waiting.set()  # its descriptor is open on the owner's file
        return real_flock(fd, operation)

    def waiter():
        with run_lock(tmp_path, wait=True):
            locked.set()
            leave.wait(30)

    monkeypatch.setattr(run_lock_module.fcntl, "flock", flock)
    thread = threading.Thread(target=waiter, name="waiter")
    with run_lock(tmp_path):
        thread.start()
        assert waiting.wait(30)
    try:
        assert locked.wait(30)
        with pytest.raises(RunDirectoryBusy, match=f"pid {os.getpid()}"), run_lock(tmp_path):
            pass
    finally:
        leave.set()
        thread.join()
    assert list(tmp_path.iterdir()) == []


def test_the_kernel_releases_the_lock_of_a_killed_owner(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    owner = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert owner.stdout.readline() == b"locked\n"
        with pytest.raises(RunDirectoryBusy, match=f"pid {owner.pid}"), run_lock(tmp_path):
            pass
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert (tmp_path / LOCK_FILE).exists()  # a killed owner leaves its file: the next one takes it over
    with run_lock(tmp_path) as path:
        assert path.read_text() == f"{os.getpid()}\n"
    assert not path.exists()
