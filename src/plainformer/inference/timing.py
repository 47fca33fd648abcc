"""Choosing among kernels that compute the same product by timing them on this machine.

Which of torch's CPU kernels is fastest depends on the CPU (its vector units, the code paths its BLAS
takes on it) and the dtype, so the choice is measured, not assumed. Each candidate runs once to warm
up (first calls build oneDNN primitives and fbgemm's packings), then `rounds` interleaved rounds, so
that a burst of load from elsewhere slows them all alike; each candidate's best round counts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping

import torch


def fastest(candidates: Mapping[str, Callable[[], object]], rounds: int = 3, *,
            autograd: bool = False) -> tuple[str, dict[str, float]]:
    """-> (the name of the fastest candidate, each one's best seconds). A candidate that raises a
    RuntimeError (a kernel this CPU or build lacks) counts as never finishing (inf seconds); when
    none runs, that is a RuntimeError. The candidates run in inference mode, or with autograd on
    (`autograd=True`: candidates that time a backward pass)."""
    if not candidates:
        raise ValueError("fastest needs at least one candidate")
    seconds = {name: float("inf") for name in candidates}
    runs = dict(candidates)
    with contextlib.nullcontext() if autograd else torch.inference_mode():
        for name, call in list(runs.items()):
            if not _runs(call):
                del runs[name]
        if not runs:
            raise RuntimeError(f"none of the kernels {', '.join(candidates)} runs here")
        for _ in range(rounds):
            for name, call in runs.items():
                start = time.perf_counter()
                call()
                seconds[name] = min(seconds[name], time.perf_counter() - start)
    return min(seconds, key=lambda name: seconds[name]), seconds


def _runs(call: Callable[[], object]) -> bool:
    try:
        call()
    except RuntimeError:
        return False
    return True
