"""The launcher `--nproc` runs: torchrun's, with a failed rank reported by its status and at most one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from plainformer.training import torchrun


def _failing(exitcode: int):
    def run(args):
        failure = ProcessFailure(local_rank=1, pid=123, exitcode=exitcode, error_file="<none>")
        raise ChildFailedError("plainformer", {1: failure})
    return run


@pytest.mark.parametrize("exitcode, status, line", [
    (2, 2, None),  # a user error: the rank has printed its one line
    (1, 1, "plainformer: error: rank 1 failed (exit status 1); its own output is above"),
    (-9, 1, "plainformer: error: rank 1 failed (signal SIGKILL); its own output is above"),
])
def test_a_failed_rank_is_reported_by_its_status_and_at_most_one_line(monkeypatch, capsys, exitcode, status, line):
    monkeypatch.setattr(torchrun, "run", _failing(exitcode))
    assert torchrun.main(["--standalone", "--nproc-per-node=2", "-m", "plainformer"]) == status
    assert capsys.readouterr().err.splitlines() == ([] if line is None else [line])


@pytest.mark.parametrize("exitcodes, status, line", [
    # rank 0 said it lost rank 1 (its exit may be seen first): rank 1's end is the cause
    ((2, -9, -15), 1, "plainformer: error: rank 1 failed (signal SIGKILL); its own output is above"),
    # rank 1 printed a user error; the agent stopped the others with SIGTERM (the default, or the ranks' exit)
    ((-15, 2, 143), 2, None),
    ((-15, -15, -15), 1, "plainformer: error: rank 0 failed (signal SIGTERM); its own output is above"),
])
def test_the_rank_reported_is_the_one_whose_failure_ended_the_others(monkeypatch, capsys, exitcodes, status, line):
    def run(args):
        failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="<none>")
                    for rank, code in enumerate(exitcodes)}
        for rank, failure in failures.items():
            failure.timestamp = 100 + rank  # in rank order: the consequences may be seen first
        raise ChildFailedError("plainformer", failures)

    monkeypatch.setattr(torchrun, "run", run)
    assert torchrun.main(["--standalone", "--nproc-per-node=3", "-m", "plainformer"]) == status
    assert capsys.readouterr().err.splitlines() == ([] if line is None else [line])


def test_ctrl_c_exits_128_plus_the_signal(monkeypatch, capsys):
    def interrupted(args):
        raise SignalException("interrupted", signal.SIGINT)

    monkeypatch.setattr(torchrun, "run", interrupted)
    assert torchrun.main(["--standalone", "--nproc-per-node=2", "-m", "plainformer"]) == 130
    assert capsys.readouterr().err == ""


def test_train_nproc_with_a_bad_shape_prints_one_line(tmp_path):
    data = tmp_path / "small.txt"
    data.write_text("to be or not to be, that is the question\n" * 200)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAINFORMER_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "plainformer", "train", "--nproc", "2", "--data", str(data),
                           "--n-heads", "5", "--max-steps", "1", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["plainformer: error: d_model (256) must be divisible by n_heads (5)"]
