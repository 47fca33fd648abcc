"""TensorBoard event files beside metrics.jsonl, through `torch.utils.tensorboard` (optional extra:
`pip install 'plainformer[tensorboard]'`).

Every record the trainer appends to metrics.jsonl — train loss, learning rate, tokens/s, gradient norm,
validation loss, and whatever else a model family records (MoE statistics) — becomes one scalar per
number at the record's step, in OUT/tensorboard/; `tensorboard --logdir OUT` shows them. The losses
share a section: train_loss -> loss/train, val_loss -> loss/val.
"""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

EVENTS_DIR = "tensorboard"
TAGS = {"train_loss": "loss/train", "val_loss": "loss/val"}

Record = Callable[[int, Mapping[str, Any]], None]


def _summary_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("tensorboard=True needs the tensorboard package, which is not installed: "
                         "pip install 'plainformer[tensorboard]' (or pip install tensorboard)") from None
    return SummaryWriter(log_dir=str(log_dir))


@contextlib.contextmanager
def tensorboard_log(out_dir: str | os.PathLike, enabled: bool) -> Iterator[Record]:
    """record(step, values): each number in values as a scalar at step (a no-op when not enabled)."""
    if not enabled:
        yield lambda step, values: None
        return
    writer = _summary_writer(Path(out_dir) / EVENTS_DIR)

    def record(step: int, values: Mapping[str, Any]) -> None:
        for name, value in values.items():
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                writer.add_scalar(TAGS.get(name, name), float(value), step)
        writer.flush()  # why: a run watched live, or interrupted, shows every step logged so far

    try:
        yield record
    finally:
        writer.close()
