"""What every model family's class shares: `from_checkpoint`, which builds the model from the config a
checkpoint saved and loads its weights, checked against the family the checkpoint names."""

from __future__ import annotations

import os
from typing import Any, ClassVar, Self

import torch
from torch import nn

from ..checkpoint.format import Checkpoint, CheckpointError, load_checkpoint
from ..config import Config


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
        model = cls(checkpoint.config(cls.config_class))  # every family takes its config
        checkpoint.restore_model(model)
        model.to(map_location)
        model.tokenizer = checkpoint.load_tokenizer() if checkpoint.has_tokenizer else None
        return model.eval()
