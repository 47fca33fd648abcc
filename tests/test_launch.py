"""Where this process sits in a launch and `process_seconds` (launch.py): torchrun's RANK / WORLD_SIZE /
LOCAL_RANK, an initialised process group over them, and how long this process has run."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from plainformer.launch import Launch, current_launch, is_main_process, launch_from_env, process_seconds


def test_one_process_is_the_main_one():
    assert Launch() == Launch(rank=0, world_size=1, local_rank=0) and Launch().is_main


def test_launch_is_read_from_torchruns_environment():
    assert launch_from_env({}).world_size == 1
    launch = launch_from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.is_main) == (3, 8, 1, False)
    with pytest.raises(ValueError, match="RANK=8, WORLD_SIZE=8"):
        launch_from_env({"RANK": "8", "WORLD_SIZE": "8", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="integer RANK"):
        launch_from_env({"WORLD_SIZE": "2"})


def test_the_local_rank_defaults_to_the_rank_and_is_never_negative():
    assert launch_from_env({"RANK": "2", "WORLD_SIZE": "4"}) == Launch(2, 4, 2)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=-1: need WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE and "):
        launch_from_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"})
    with pytest.raises(ValueError, match=r"RANK=0, WORLD_SIZE=0"):
        launch_from_env({"RANK": "0", "WORLD_SIZE": "0"})


def test_an_initialised_process_group_decides_rank_and_size_the_environment_the_local_rank(environ, tmp_path):
    environ(2, 4, 1)
    assert current_launch() == Launch(2, 4, 1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert current_launch() == Launch(0, 1, 1) and is_main_process()
    finally:
        dist.destroy_process_group()


def test_process_seconds_count_from_the_start_of_the_interpreter():
    # A child that sleeps 0.5 s before it imports anything, then reads its own age: /proc's ticks are 10 ms.
    code = "import time; time.sleep(0.5); from plainformer.launch import process_seconds; print(process_seconds())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert 0.5 <= float(done.stdout) < 60


def test_process_seconds_grow_with_the_wall_clock():
    import time

    first = process_seconds()
    time.sleep(0.05)
    assert first is not None and process_seconds() >= first + 0.04


def test_without_proc_the_age_is_unknown(monkeypatch):
    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(builtins, "open", no_proc)
    assert process_seconds() is None
