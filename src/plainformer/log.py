"""`log`, the line on stderr that only one process of a launch writes: what every layer may use, from the
models up to the command line."""

from __future__ import annotations

import sys

from .launch import is_main_process


def log(message: str) -> None:
    """A line on stderr, from rank 0 only under torchrun."""
    if is_main_process():
        print(message, file=sys.stderr, flush=True)
