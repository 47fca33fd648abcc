"""What every model family's class shares.

- The constructor's opening, `FamilyModel.__init__(config)`: the config's type checked, the model's
  bytes checked against the memory available before anything is allocated, `config` and `tokenizer` set.
- What a model of a config holds, counted, not restated: `footprint(config)` builds the model on the
  meta device (no memory) and counts its parameters and buffers, each tensor once (a tied head is the
  embedding). A stack of identical layers is built one layer deep and counted as many times as it is
  deep (`shallow`), so that a config of n_layers=10**6 is counted, and refused, at once:

      bytes = P · s + buffers + N_tensors · 2 kB         s = the bytes of an element (4 in float32)

  2 kB per tensor is what the Python objects of a tiny tensor and its module measured (about 2.7 kB),
  which is what a 100,000-layer model of tiny widths mostly costs. Building briefly holds a little more:
  the float64 tables the positional buffers are computed from, an output projection before it is tied.
- `from_checkpoint`, which builds the model from the config a checkpoint saved and loads its weights,
  checked against the family the checkpoint names and, before anything is built, against the number
  of values its weights file holds.

Every class that names a `family` is found by it (`model_class`): a new family adds no line here. What a
model keeps while it runs (activations, caches) is estimated above the models, in
families/memory_estimates.py; what it holds is counted here, because the constructor refuses a model too
large before it builds it.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import torch
from torch import nn

from .. import _checks
from ..checkpoint.format import CONFIG, MODEL, Checkpoint, CheckpointError, load_checkpoint
from ..config import Config
from ..memory import check_memory

TENSOR_OVERHEAD = 2048  # bytes per tensor beyond its elements: the Python objects (see the docstring)

_CLASSES: dict[str, type[FamilyModel]] = {}  # family name -> its class, in the order they are defined
_counting: contextvars.ContextVar[bool] = contextvars.ContextVar("counting", default=False)  # inside `footprint`


@dataclasses.dataclass
class Footprint:
    """What a model holds: its parameters (each counted once), those of them that are the 2-D weights of
    linear layers inside the blocks (what Muon trains), its tensors (parameters and buffers) and the
    bytes of its buffers."""

    parameters: int = 0
    block_matrices: int = 0
    tensors: int = 0
    buffer_bytes: int = 0


def block_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The hidden matrices Muon trains: 2-D weights of nn.Linear modules that sit inside an
    nn.ModuleList (the blocks), never an embedding (so not a head tied to one)."""
    skip = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)  # and, later, the ones taken
            for p in m.parameters(recurse=False)}
    hidden = []
    for stack in (m for m in model.modules() if isinstance(m, nn.ModuleList)):
        for linear in (m for m in stack.modules() if isinstance(m, nn.Linear)):
            p = linear.weight
            if p.requires_grad and p.ndim == 2 and id(p) not in skip:
                skip.add(id(p))
                hidden.append(p)
    return hidden


def count(model: nn.Module, times: Mapping[str, int] | None = None) -> Footprint:
    """What `model` holds, each tensor once; the tensors of a submodule named in `times` ("blocks.0",
    at any depth: "layers.0" is "bert.layers.0" too) count `times[name]` times."""
    times = times or {}
    hidden = {id(p) for p in block_matrices(model)}
    found = Footprint()
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor, bool]] = [(name, t, False) for name, t in model.named_parameters()]
    named += [(name, t, True) for name, t in model.named_buffers()]
    for name, tensor, is_buffer in named:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        copies = next((n for key, n in times.items() if f".{key}." in f".{name}"), 1)
        found.tensors += copies
        if is_buffer:
            found.buffer_bytes += copies * tensor.numel() * tensor.element_size()
        else:
            found.parameters += copies * tensor.numel()
            found.block_matrices += copies * tensor.numel() if id(tensor) in hidden else 0
    return found


def unchecked(config: Any, **changes: Any) -> Any:
    """A copy of `config` with `changes`, not validated again (a shallow stack of a deep config's layers)."""
    changed = copy.copy(config)
    for name, value in changes.items():
        setattr(changed, name, value)
    return changed


def model_class(config: Any, family: str | None = None) -> type[FamilyModel]:
    """The class of `family` (default: the first class defined for the config's type, BertModel for a
    BertConfig); a ValueError naming the families when there is none."""
    if family is None:
        family = next((name for name, cls in _CLASSES.items() if cls.config_class is type(config)), None)
    if family not in _CLASSES:
        raise ValueError(f"family must be one of {', '.join(_CLASSES)} for a {type(config).__name__}, "
                         f"got {family!r}")
    return _CLASSES[family]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


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
        if not _counting.get():  # `footprint`'s own build, of a config checked by the constructor that asked
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
    def footprint(cls, config: Any) -> Footprint:
        """What the model of `config` holds, counted on the meta device. A vocabulary size of 0 (one the
        data decides, not known yet) is no model to build: what it holds is a polynomial of degree at most
        2 in that size (quadratic with GPT's bigram table), so it is counted at three sizes a, 2a and 3a past
        every special id, f(0) = 3 f(a) - 3 f(2a) + f(3a)."""
        unknown = [f.name for f in dataclasses.fields(config)
                   if f.name.endswith("vocab_size") and getattr(config, f.name) == 0]
        if unknown:
            ids = (getattr(config, f.name) for f in dataclasses.fields(config) if f.name.endswith("_id"))
            a = 1 + max((i for i in ids if _checks.is_int(i)), default=0)
            one, two, three = (dataclasses.astuple(cls.footprint(unchecked(config, **dict.fromkeys(unknown, k * a))))
                               for k in (1, 2, 3))
            return Footprint(*(3 * x - 3 * y + z for x, y, z in zip(one, two, three, strict=True)))
        built, times = cls.shallow(config)
        token = _counting.set(True)
        try:
            with torch.device("meta"):
                model = cls(built)
        finally:
            _counting.reset(token)
        return count(model, times)

    @classmethod
    def model_bytes(cls, config: Any, dtype: torch.dtype = torch.float32) -> int:
        """The bytes of the model of `config` with its parameters in `dtype`: parameters, buffers (as
        built) and the per-tensor overhead."""
        f = cls.footprint(config)
        return f.parameters * itemsize(dtype) + f.buffer_bytes + f.tensors * TENSOR_OVERHEAD

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
        check_memory("the model needs ~{needed} for its parameters and buffers", cls.model_bytes, config)


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
