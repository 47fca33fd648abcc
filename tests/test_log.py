"""`log` (log.py): the one line on stderr that only the main process of a launch writes."""

from __future__ import annotations

import pytest

from plainformer.launch import is_main_process
from plainformer.log import log


def test_log_writes_one_line_to_stderr_and_nothing_to_stdout(environ, capsys):
    log("step 1: loss 2.5")
    assert capsys.readouterr() == ("", "step 1: loss 2.5\n")


@pytest.mark.parametrize("rank, written", [(0, "a line\n"), (1, "")])
def test_under_torchrun_only_rank_zero_logs(rank, written, environ, capsys):
    environ(rank, 2, rank)
    assert is_main_process() == (rank == 0)
    log("a line")
    assert capsys.readouterr() == ("", written)
