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
