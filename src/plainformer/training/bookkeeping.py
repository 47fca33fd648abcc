"""The Trainer's bookkeeping: a Ctrl-C that asks for a clean stop, the two ways a run ends early
(`TrainingInterrupted`, `TrainingDiverged`), the clock of training steps, the seconds of everything else a
run does, the losses and tokens since the last log line, and metrics.jsonl cut back to a resumed step."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import _checks
from ..errors import UserError
from ..files.atomic import atomic_path


class InterruptRequest:
    """While active, the first SIGINT only sets `requested`; a second one raises KeyboardInterrupt.
    Nothing is printed from the handler: writing to stderr there can re-enter tqdm's write."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> InterruptRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            previous = self._previous if self._previous is not None else signal.default_int_handler
            signal.signal(signal.SIGINT, previous)


class TrainingDiverged(UserError):
    """Raised by `Trainer.fit` when a step's loss or gradient norm is not finite: nothing after the
    last finite step is saved, so last/ and best/ stay what they were."""

    def __init__(self, step: int | None, saved: int | None):
        when = f"at step {step}" if step is not None else "(on another rank)"
        kept = (f"last/ holds step {saved}, the last one saved" if saved else "no checkpoint was saved")
        super().__init__(f"training diverged {when}: the loss or the gradient norm is NaN or infinite; {kept}. "
                         "Lower --lr, or raise --warmup-steps or --grad-clip, and train again")
        self.step = step


class TrainingInterrupted(Exception):
    """Raised by `Trainer.fit` after Ctrl-C, once the current step finished and `last/` was saved."""

    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"training interrupted at step {step}; checkpoint saved to {checkpoint} "
                         "(continue with resume=True, or --resume on the command line)")
        self.step = step
        self.checkpoint = checkpoint


class Stopwatch:
    """Seconds spent in training steps, leaving out evaluation, logging and checkpointing. It runs
    across consecutive steps and stops (on CUDA: synchronises) only before something else happens,
    so the device is not drained after every step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.total = 0.0
        self._since: float | None = None

    def start(self) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    def stop(self) -> None:
        if self._since is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.total += time.perf_counter() - self._since
            self._since = None


class Phases:
    """Wall seconds a session spends in each named phase outside the steps (evaluation, checkpoints,
    logging), so that a run can say where its time went."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def breakdown(self, steps: float, session: float) -> dict[str, float]:
        """{"steps": steps, each phase's seconds, "other": the rest of the `session`'s seconds}."""
        return {"steps": steps, **self.seconds, "other": max(session - steps - sum(self.seconds.values()), 0.0)}


class LogWindow:
    """Loss and input tokens since the last log line. The loss stays a device tensor until it is
    logged, so the hot loop never waits on `.item()`."""

    def __init__(self, device: torch.device, dtype: torch.dtype, loss_sum: float = 0.0, steps: int = 0):
        self.loss = torch.tensor(loss_sum, dtype=dtype, device=device)
        self.steps, self.tokens, self.total_tokens = steps, 0, 0
        self._mark = 0.0  # training seconds at the last flush
        self._after_first: tuple[int, float] | None = None  # (total_tokens, seconds) after step 1

    def add(self, loss: Tensor, tokens: int, train_seconds: float) -> None:
        self.loss += loss
        self.steps += 1
        self.tokens += tokens
        self.total_tokens += tokens
        if self._after_first is None:
            self._after_first = (self.total_tokens, train_seconds)

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to log the same mean loss: the unlogged steps' loss sum (float32
        or float64, exact in JSON) and their number."""
        return {"loss_sum": self.loss.item(), "steps": self.steps}

    def throughput(self, train_seconds: float) -> float:
        """Input tokens per training second over the session, leaving out the first step (it pays
        for torch.compile, lazy initialisation and allocator warm-up) when there are others."""
        if self._after_first is None:
            return 0.0
        first_tokens, first_seconds = self._after_first
        if self.total_tokens > first_tokens and train_seconds > first_seconds:
            return (self.total_tokens - first_tokens) / (train_seconds - first_seconds)
        return self.total_tokens / max(train_seconds, 1e-9)

    def flush(self, train_seconds: float, reduce=lambda loss: loss) -> tuple[float, float]:
        """-> (mean loss per step, `reduce`d: over ranks; input tokens per training second) since
        the last flush."""
        mean_loss = reduce(self.loss / self.steps).item()
        tokens_per_s = self.tokens / max(train_seconds - self._mark, 1e-9)
        self.loss.zero_()
        self.steps = self.tokens = 0
        self._mark = train_seconds
        return mean_loss, tokens_per_s


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` (a resumed run logs them again; a fresh run, step 0,
    starts an empty file), and lines that are not a record of a step (the half-written last line of
    a killed run). Rewritten atomically."""
    kept = []
    if step > 0 and path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                logged = record.get("step") if isinstance(record, dict) else None
                if _checks.is_int(logged) and logged <= step:
                    kept.append(line + "\n")
    with atomic_path(path) as tmp:
        tmp.write_text("".join(kept))
