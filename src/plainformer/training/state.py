"""The trainer state a resume continues from, besides weights, optimizer and RNG states: `TrainerState`,
the one schema of a checkpoint's trainer_state.json.

The trainer writes `TrainerState(...).to_dict()` as `save_checkpoint(trainer_state=...)`, which adds the
RNG states to the same file ("rng", "rng_other_ranks"); `TrainerState.from_checkpoint` reads it back,
leaving those keys to the checkpoint, and refuses a file that lacks a field or holds a malformed one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import _checks
from ..checkpoint.format import TRAINER_STATE, Checkpoint, CheckpointError
from ..config import Config


def _empty_log_window() -> dict[str, Any]:
    return {"loss_sum": 0.0, "steps": 0}


@dataclasses.dataclass
class TrainerState(Config):
    """Where a run stands after `step` optimizer steps.

    data_position: micro-batches drawn so far, the index of the next; best_val_loss, train_loss, val_loss:
    the lowest and the latest logged losses (None before the first); best_metric: the best value of the
    validation metric best/ is chosen by, when the source has one (`trainer.Selection`); elapsed_s:
    wall-clock seconds of the run, sessions before a resume included; world_size: processes that wrote
    it; evaluated_step: the step of the latest evaluation; log_window: the loss sum and number of the
    steps since the last log line, so that a resumed run logs the same mean; planned_steps: max_steps as
    fit_to_time planned it. The fields with defaults are absent from checkpoints of older plainformers; those of the
    plainformers that chose the linear layers' kernels in the Trainer hold them as "linear_kernels", which
    is no field: the run's kernels are its own (`kernels.kept_kernels` reads them).
    """

    step: int
    data_position: int
    best_val_loss: float | None
    train_loss: float | None
    val_loss: float | None
    elapsed_s: float
    world_size: int | None = None
    evaluated_step: int | None = None
    log_window: dict[str, Any] = dataclasses.field(default_factory=_empty_log_window)
    planned_steps: int | None = None
    best_metric: float | None = None

    @classmethod
    def fresh(cls) -> TrainerState:
        """The state of a run before its first step."""
        return cls(step=0, data_position=0, best_val_loss=None, train_loss=None, val_loss=None, elapsed_s=0.0)

    def __post_init__(self) -> None:
        # Not Config's per-field check: it stops at the first bad field and refuses a NaN loss, while a
        # resume names every malformed field at once and continues a run whose loss diverged.
        self.validate()

    def validate(self) -> None:
        """ValueError naming every malformed field: counts are ints >= 0, losses and elapsed_s numbers
        (NaN and inf included), log_window {"loss_sum": number, "steps": count}."""
        window = self.log_window
        valid = {
            "step": _count(self.step), "data_position": _count(self.data_position),
            **{name: getattr(self, name) is None or _checks.is_number(getattr(self, name))
               for name in ("best_val_loss", "train_loss", "val_loss", "best_metric")},
            "elapsed_s": _checks.is_number(self.elapsed_s),
            **{name: getattr(self, name) is None or _count(getattr(self, name))
               for name in ("world_size", "evaluated_step", "planned_steps")},
            "log_window": isinstance(window, dict) and set(window) == {"loss_sum", "steps"}
                          and _checks.is_number(window["loss_sum"]) and _count(window["steps"]),
        }
        bad = [name for name, ok in valid.items() if not ok]
        if bad:
            raise ValueError(f"{', '.join(bad)} malformed (expected counts >= 0 and numbers)")

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint) -> TrainerState:
        """The state in `checkpoint`'s trainer_state.json; a CheckpointError naming the file when it
        is absent, lacks a field without a default or holds a malformed one. Keys that are no field
        (the RNG states) are left to the checkpoint."""
        file = checkpoint.path / TRAINER_STATE
        values = checkpoint.trainer_state
        if values is None:
            raise CheckpointError(f"{checkpoint.path} holds no trainer state ({TRAINER_STATE} is missing)")
        fields = dataclasses.fields(cls)
        missing = [f.name for f in fields if f.name not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise CheckpointError(f"{file} lacks {', '.join(map(repr, missing))}")
        try:
            return cls.from_dict({f.name: values[f.name] for f in fields if f.name in values})
        except ValueError as e:
            raise CheckpointError(f"{file}: {e}") from None


def _count(value: Any) -> bool:
    return _checks.is_int(value) and value >= 0
