"""Where this process sits in a launch, and how long this process has run: what every layer may use, from
the models up to the command line.

A process started by `torchrun` has RANK, WORLD_SIZE and LOCAL_RANK in its environment; once the
training initialises torch.distributed's process group (training/distributed.py), the group says. Rank 0,
or the one process of a plain run, is the main process: the one that prints and writes files.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process sits in the job: rank of world_size, local_rank on its machine."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_from_env(environ: Mapping[str, str] = os.environ) -> Launch:
    """The launch torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK; one process when they are unset."""
    if "WORLD_SIZE" not in environ:
        return Launch()
    try:
        rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local_rank = int(environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError) as e:
        raise ValueError(f"a distributed launch needs integer RANK, WORLD_SIZE and LOCAL_RANK in the "
                         f"environment (torchrun sets them): {e}") from None
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ValueError(f"RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}: need "
                         "WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0")
    return Launch(rank, world_size, local_rank)


def is_main_process() -> bool:
    """True on rank 0 and in a single process: the one process that prints and writes files."""
    return current_launch().is_main


def process_seconds() -> float | None:
    """Wall seconds since this process started (its interpreter's start, before any import), from
    /proc/self/stat's start time in clock ticks since boot; None where there is no /proc (not Linux)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            # Fields after the command name, which is in parentheses and may hold spaces: starttime is the 22nd.
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            since_boot = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(since_boot - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def current_launch() -> Launch:
    """The initialised process group's rank and size, else the environment's."""
    if dist.is_available() and dist.is_initialized():
        return Launch(dist.get_rank(), dist.get_world_size(), launch_from_env().local_rank)
    return launch_from_env()
