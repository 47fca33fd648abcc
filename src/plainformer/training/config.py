"""The training recipe: `TrainConfig`, validated once when it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ..config import Config, non_negative_int, non_negative_number, one_of, positive_int, positive_number, probability

SCHEDULES = ("cosine", "linear", "constant", "inverse_sqrt")


# "auto": bfloat16 where bf16 matmuls are natively fast, float32 elsewhere (training/precision.py).
DTYPES = ("auto", "float32", "bfloat16")
OPTIMIZERS = ("adamw", "muon")

PARALLEL = ("auto", "ddp", "fsdp", "none")  # see training/distributed.py


@dataclasses.dataclass
class TrainConfig(Config):
    """How to train. Intervals count optimizer steps; 0 turns periodic evaluation or saving off (both still happen
    at the end), grad_clip 0 turns clipping off. `lr` is the peak rate (the factor in front of the inverse_sqrt
    formula); `min_lr` is where the cosine or linear decay ends, at `decay_steps` (default max_steps).
    `max_time` (seconds, wall clock, including time spent before a resume) stops training early and gracefully;
    with `fit_to_time` it also sets the length: at the end of warmup, max_steps is lowered to the steps that
    end by max_time at the speed measured so far (evaluations and the final save included), and set once more
    halfway from the warm steps since (up to the max_steps given), so that the schedule has annealed when time
    is up, on a fast machine or a slow one (kept in the checkpoint: a resume continues that plan). A micro-batch
    holds `batch_size` rows per process; an optimizer step `batch_size * grad_accum_steps * world_size`.
    `parallel` picks DDP or FSDP2 under torchrun ("auto": DDP when there is more than one process). `optimizer`
    "muon" trains the blocks' matrices with Muon at peak rate `muon_lr` (same schedule) and everything else with
    AdamW (training/optim.py). `dtype` "auto" is bfloat16 autocast where bf16 matmuls are natively fast (on a CPU:
    for a model at least 128 wide), float32 elsewhere (training/precision.py). `keep_checkpoints` N keeps the
    weights of the last N saves of last/ as OUT/checkpoints/step-NNNNNNN, to average (checkpoint/average.py)."""

    max_steps: int = positive_int(2000)
    batch_size: int = positive_int(12)
    grad_accum_steps: int = positive_int(1)
    lr: float = positive_number(1e-3)
    min_lr: float = non_negative_number(1e-4)
    warmup_steps: int = non_negative_int(100)
    schedule: str = one_of("cosine", SCHEDULES)
    decay_steps: int | None = positive_int(None)
    schedule_d_model: int | None = positive_int(None)
    weight_decay: float = non_negative_number(0.1)
    optimizer: str = one_of("adamw", OPTIMIZERS)
    muon_lr: float = positive_number(0.02)
    beta1: float = probability(0.9)
    beta2: float = probability(0.99)
    eps: float = positive_number(1e-8)
    grad_clip: float = non_negative_number(1.0)
    eval_interval: int = non_negative_int(250)
    eval_batches: int = positive_int(20)
    eval_batch_size: int | None = positive_int(None)
    log_interval: int = positive_int(10)
    save_interval: int = non_negative_int(250)
    keep_checkpoints: int = non_negative_int(0)
    dtype: str = one_of("auto", DTYPES)
    seed: int = non_negative_int(1337)
    max_time: float | None = positive_number(None)
    fit_to_time: bool = False
    compile: bool = False
    parallel: str = one_of("auto", PARALLEL)
    tensorboard: bool = False

    HELP: ClassVar[Mapping[str, str]] = {
        "max_steps": "optimizer steps to train",
        "batch_size": "rows of a micro-batch, per process",
        "grad_accum_steps": "micro-batches per optimizer step",
        "lr": "peak learning rate; inverse_sqrt: its formula's factor",
        "min_lr": "where the cosine or linear decay ends",
        "warmup_steps": "steps of linear warmup to lr",
        "schedule": "the learning rate's schedule",
        "decay_steps": "the step the decay reaches min_lr at; none: max_steps",
        "schedule_d_model": "inverse_sqrt's d_model; none: the model's",
        "weight_decay": "AdamW's decoupled weight decay",
        "optimizer": "muon: Muon for the blocks' matrices, AdamW for the rest",
        "muon_lr": "Muon's peak learning rate, on the same schedule",
        "beta1": "Adam's β1",
        "beta2": "Adam's β2",
        "eps": "Adam's ε",
        "grad_clip": "clip the gradients' global norm to this; 0: off",
        "eval_interval": "steps between evaluations; 0: at the end only",
        "eval_batches": "validation batches an evaluation reads",
        "eval_batch_size": "rows of a validation batch; none: batch_size",
        "log_interval": "steps between log lines",
        "save_interval": "steps between saves of last/; 0: at the end only",
        "keep_checkpoints": "keep the last N saves' weights in OUT/checkpoints",
        "dtype": "auto: bfloat16 autocast where its matmuls are fast",
        "seed": "seed of the weights, the batches and dropout",
        "max_time": "stop gracefully at X wall-clock seconds; none: never",
        "fit_to_time": "fit max_steps to max_time at the speed measured",
        "compile": "torch.compile the model",
        "parallel": "under torchrun; auto: DDP with several processes",
        "tensorboard": "write TensorBoard scalars to OUT/tensorboard",
    }

    # Optimizer recipes shared by several training recipes; the named recipes of every family
    # (`plainformer train --recipe NAME`) are in `plainformer.recipes`.
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        # Vaswani et al. 2017, section 5.3: Adam(0.9, 0.98, 1e-9), inverse-sqrt with 4000 warmup steps.
        "transformer-paper": dict(schedule="inverse_sqrt", lr=1.0, warmup_steps=4000,
                                  schedule_d_model=512, beta1=0.9, beta2=0.98, eps=1e-9,
                                  weight_decay=0.0, grad_clip=0.0, max_steps=100_000),
    }

    def validate(self) -> None:
        if self.fit_to_time and self.max_time is None:
            raise ValueError("fit_to_time needs max_time (the seconds to fit the steps into), got None")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps ({self.decay_steps}) must exceed warmup_steps "
                             f"({self.warmup_steps})")
        if self.schedule in ("cosine", "linear") and self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.schedule == "inverse_sqrt" and (self.schedule_d_model is None or self.warmup_steps == 0):
            raise ValueError("schedule 'inverse_sqrt' needs schedule_d_model (the model's d_model) and "
                             f"warmup_steps >= 1; got schedule_d_model={self.schedule_d_model}, "
                             f"warmup_steps={self.warmup_steps}")
