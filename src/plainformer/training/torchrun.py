"""torchrun, reporting a failed rank by its exit status and at most one line, never a traceback.

    python -m plainformer.training.torchrun --standalone --nproc-per-node=N -m plainformer ARGV

The same launcher as `python -m torch.distributed.run` (its `parse_args` and `run`), quieter where the
ranks have already spoken: a rank that exits with a user error has printed its `plainformer: error:`
line (or rank 0 has printed it), so the launcher exits with that status and adds nothing (torchrun itself
would add its warning and error log lines and a `ChildFailedError` traceback). A rank that crashed or
was killed gets one line naming the rank and how it ended, the first such rank being the cause of the
others' errors (they say which rank they lost); after Ctrl-C the launcher exits 128 + the signal.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Mapping, Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

USER_ERROR = 2  # the status `plainformer` exits with after its one-line error


def _quiet_elastic_logs() -> None:
    """The elastic agent's loggers, each given its own level when created, raised above ERROR."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _cause(failures: Mapping[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(rank, failure) of the rank whose failure ended the launch: the first to fail (by time, then rank)
    that neither said so itself (USER_ERROR: a user error, or the ranks it lost) nor was stopped by the
    agent (SIGTERM, which the ranks turn into exit status 128 + SIGTERM) once another had failed; else the
    first to say so; else the first."""
    ranks = sorted(failures, key=lambda rank: (failures[rank].timestamp, rank))
    for said in (False, True):
        for rank in ranks:
            code = failures[rank].exitcode
            if code not in (-signal.SIGTERM, 128 + signal.SIGTERM) and (code == USER_ERROR) == said:
                return rank, failures[rank]
    return ranks[0], failures[ranks[0]]


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_elastic_logs()
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as failed:
        rank, failure = _cause(failed.failures)
        if failure.exitcode == USER_ERROR:
            return USER_ERROR
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
        print(f"plainformer: error: rank {rank} failed ({how}); its own output is above", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as stop:
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
