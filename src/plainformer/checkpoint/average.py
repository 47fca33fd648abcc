"""Checkpoint averaging (Vaswani et al. 2017, section 6.1: "averaging the last 5 checkpoints").

    θ̄ = (1/N) Σ_i θ_i                   every floating-point weight, in float64, stored in its own dtype

The checkpoints must hold one model: the same family, config and weight names. A run keeps the weights of
its last saves for this with TrainConfig.keep_checkpoints, as OUT/checkpoints/step-NNNNNNN
(`kept_checkpoints`); `plainformer average` and the translation recipes average them.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from ..files.atomic import atomic_directory
from .format import CheckpointError, load_checkpoint, save_checkpoint

KEPT_DIR = "checkpoints"  # OUT/checkpoints/step-NNNNNNN: the weights of a run's last saves
_STEP = re.compile(r"step-(\d+)")


def kept_checkpoint(out_dir: str | os.PathLike, step: int) -> Path:
    return Path(out_dir) / KEPT_DIR / f"step-{step:07d}"


def kept_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """The checkpoints a run keeps for averaging, oldest first."""
    folder = Path(out_dir) / KEPT_DIR
    found = [p for p in folder.iterdir() if p.is_dir() and _STEP.fullmatch(p.name)] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def keep_last(out_dir: str | os.PathLike, count: int) -> None:
    """Remove the kept checkpoints but the newest `count`."""
    for old in kept_checkpoints(out_dir)[:-count]:
        shutil.rmtree(old, ignore_errors=True)


def average_checkpoints(paths: Sequence[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Write to `out` (atomically) the checkpoint whose weights are the mean of those of `paths`, with the
    first one's config, tokenizer and train config (no optimizer or trainer state). Returns `out`."""
    if len(paths) < 1:
        raise ValueError("average_checkpoints needs at least one checkpoint")
    checkpoints = [load_checkpoint(path) for path in paths]
    first = checkpoints[0]
    for other in checkpoints[1:]:
        if (other.family, other.model_config, other.adapter) != (first.family, first.model_config, first.adapter):
            raise CheckpointError(f"{other.path} holds another model than {first.path} (family, config or adapter "
                                  "differ): only checkpoints of one run's model average")
        if set(other.state_dict) != set(first.state_dict):
            raise CheckpointError(f"{other.path} holds other weights than {first.path}")
    averaged: dict[str, torch.Tensor] = {}
    shared: dict[int, torch.Tensor] = {}  # tied weights (one tensor under two names) stay one tensor
    for name, tensor in first.state_dict.items():
        if tensor.data_ptr() not in shared:
            total = torch.stack([c.state_dict[name].to(torch.float64) for c in checkpoints]).sum(dim=0)
            shared[tensor.data_ptr()] = ((total / len(checkpoints)).to(tensor.dtype) if tensor.is_floating_point()
                                         else tensor)
        averaged[name] = shared[tensor.data_ptr()]
    tokenizer = first.load_tokenizer() if first.has_tokenizer else None
    return save_checkpoint(out, model=averaged, family=first.family, model_config=first.model_config,
                           train_config=first.train_config, tokenizer=tokenizer, adapter=first.adapter)


def replace_checkpoint(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Copy the checkpoint directory `source` over `target`, atomically (`target` is whole before and after)."""
    load_checkpoint(source)  # verified before it replaces anything
    with atomic_directory(target) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
    return Path(target)
