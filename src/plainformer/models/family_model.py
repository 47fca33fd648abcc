"""What every model family's class shares.

- The constructor's opening, `FamilyModel.__init__(config)`: the config's type checked, the model's
  bytes checked against the memory available before anything is allocated, `config` and `tokenizer` set.
- Each family's `shallow(config)`: its model with every stack of identical layers one layer deep, and how
  many times each such layer counts, which is how plainformer/memory.py counts what a model holds
  (`footprint`, `model_bytes`) without building it whole.
- `from_checkpoint`, which builds the model from the config a checkpoint saved and loads its weights,
  checked against the family the checkpoint names and, before anything is built, against the number
  of values its weights file holds.

Every class that names a `family` is found by it (`model_class`): a new family adds no line here.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Self

import torch
from torch import nn

from .. import _checks, memory
from ..checkpoint.format import CONFIG, MODEL, Checkpoint, CheckpointError, load_checkpoint
from ..config import Config

_CLASSES: dict[str, type[FamilyModel]] = {}  # family name -> its class, in the order they are defined


def model_class(config: Any, family: str | None = None) -> type[FamilyModel]:
    """The class of `family` (default: the first class defined for the config's type, BertModel for a
    BertConfig); a ValueError naming the families when there is none."""
    if family is None:
        family = next((name for name, cls in _CLASSES.items() if cls.config_class is type(config)), None)
    if family not in _CLASSES:
        raise ValueError(f"family must be one of {', '.join(_CLASSES)} for a {type(config).__name__}, "
                         f"got {family!r}")
    return _CLASSES[family]


class FamilyModel(nn.Module):
    """A model family's class: `family` is the name its checkpoints carry, `config_class` its config."""

    family: ClassVar[str]
    config_class: ClassVar[type[Config]]
    tokenizer: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            _CLASSES.setdefault(cls.family, cls)

    def __init__(self, config: Config):
        """Checks `config` (its type, and that the model fits the memory available, before anything is
        allocated: not on the meta device, where nothing is) and keeps it; `tokenizer` is None until
        from_checkpoint or load_hf sets it."""
        super().__init__()
        if not memory.counting():  # `memory.footprint`'s own build, of a config its constructor checked
            _checks.check_type("config", config, self.config_class)
            _check_fits(type(self), config)
        self.config = config
        self.tokenizer = None

    @classmethod
    def shallow(cls, config: Any) -> tuple[Any, dict[str, int]]:
        """A config whose model holds what `config`'s does with its stacks one layer deep, and how many
        times each such layer counts ({"blocks.0": n_layers}); by default `config` itself, counted whole.
        A family whose stacks can be deep says how."""
        return config, {}

    @classmethod
    def footprint(cls, config: Any) -> memory.Footprint:
        """What the model of `config` holds, counted on the meta device (`memory.footprint`)."""
        return memory.footprint(cls, config)

    @classmethod
    def model_bytes(cls, config: Any, dtype: torch.dtype = torch.float32) -> int:
        """The bytes of the model of `config` with its parameters in `dtype` (`memory.model_bytes`)."""
        return memory.model_bytes(cls, config, dtype)

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


# The class's name until issue 47 (it is every family's base, saved or not): code that imported it keeps working.
SavedModel = FamilyModel


def check_model_memory(config: Any, family: str | None = None) -> None:
    """A MemoryBudgetError when the model of `config` would not fit the memory available: what the
    constructors (and a reader of a config.json, before the weights) call before they build anything."""
    _check_fits(model_class(config, family), config)


def _check_fits(cls: type[FamilyModel], config: Any) -> None:
    if torch.get_default_device().type != "meta":  # on the meta device nothing is allocated
        memory.check_memory("the model needs ~{needed} for its parameters and buffers", cls.model_bytes, config)


def check_stored_parameters(checkpoint: Checkpoint, config: Config) -> None:
    """A CheckpointError, before the model is built, when its config.json describes a model of more
    parameters than model.safetensors holds values (n_layers: 100000 written over a 1-layer run's, say),
    which could take minutes to build only to be refused. A LoRA checkpoint holds its adapter only: not
    checked."""
    if checkpoint.adapter is not None:
        return
    needed = model_class(config, checkpoint.family).footprint(config).parameters
    stored = sum(t.numel() for t in {id(t): t for t in checkpoint.state_dict.values()}.values())  # tied once
    if needed > stored:
        raise CheckpointError(f"{checkpoint.path / CONFIG} describes a model of {needed:,} parameters but "
                              f"{checkpoint.path / MODEL} holds {stored:,} values: they do not belong together")
