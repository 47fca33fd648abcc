"""What every model family's class shares: `from_checkpoint`, which builds the model from the config a
checkpoint saved and loads its weights, checked against the family the checkpoint names and, before
anything is built, against the number of values its weights file holds."""

from __future__ import annotations

import os
from typing import Any, ClassVar, Self

import torch
from torch import nn

from ..checkpoint.format import CONFIG, MODEL, Checkpoint, CheckpointError, load_checkpoint
from ..config import Config
from .memory import parameter_count


class SavedModel(nn.Module):
    """A model family's class: `family` is the name its checkpoints carry, `config_class` its config."""

    family: ClassVar[str]
    config_class: ClassVar[type[Config]]
    tokenizer: Any

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> Self:
        """A trained model from a checkpoint directory, in eval mode, with the saved tokenizer (if any)
        as `.tokenizer`."""
        return cls.from_loaded(load_checkpoint(directory), map_location=map_location)

    @classmethod
    def from_loaded(cls, checkpoint: Checkpoint, *, map_location: str | torch.device = "cpu") -> Self:
        """As `from_checkpoint`, from a checkpoint already read and verified."""
        if checkpoint.family != cls.family:
            raise CheckpointError(f"checkpoint {checkpoint.path} holds a {checkpoint.family!r} model, "
                                  f"not a {cls.__name__} ({cls.family!r})")
        config = checkpoint.config(cls.config_class)
        check_stored_parameters(checkpoint, config)
        model = cls(config)  # every family takes its config
        checkpoint.restore_model(model)
        model.to(map_location)
        model.tokenizer = checkpoint.load_tokenizer() if checkpoint.has_tokenizer else None
        return model.eval()


def check_stored_parameters(checkpoint: Checkpoint, config: Config) -> None:
    """A CheckpointError, before the model is built, when its config.json describes a model of more
    parameters than model.safetensors holds values (n_layers: 100000 written over a 1-layer run's, say),
    which could take minutes to build only to be refused. A LoRA checkpoint holds its adapter only: not
    checked."""
    if checkpoint.adapter is not None:
        return
    needed = parameter_count(config, checkpoint.family)
    stored = sum(t.numel() for t in {id(t): t for t in checkpoint.state_dict.values()}.values())  # tied once
    if needed > stored:
        raise CheckpointError(f"{checkpoint.path / CONFIG} describes a model of {needed:,} parameters but "
                              f"{checkpoint.path / MODEL} holds {stored:,} values: they do not belong together")
