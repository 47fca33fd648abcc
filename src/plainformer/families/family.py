"""What a model family is to the rest of the package, and a resolved recipe of one, trained.

A `Family` is registered once (`families/__init__.py`): its model and config classes, the config fields
its data decides, the recipe options it takes, how it trains and evaluates, and its Hugging Face export.
The CLI, `eval`, `export`, `attention` and the recipes look a family up by name and keep no table of
their own. A `Run` is a recipe resolved for one run directory; `fit` trains it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from torch import nn

from ..checkpoint.format import MANIFEST, Checkpoint, find_checkpoint
from ..config import Config
from ..files.atomic import atomic_path
from ..files.json_file import read_json_object
from ..hf.gpt import is_hf_directory
from ..models.saved import SavedModel
from ..training.config import TrainConfig
from ..training.distributed import log
from ..training.trainer import Trainer

RECIPE_FILE = "recipe.yaml"
#: The recipe options of LoRA, each the LoRAConfig field after "lora_".
LORA_OPTIONS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")
#: The options only a fine-tuning recipe (whose model comes from --init) takes.
FINE_TUNING_OPTIONS = ("init", *LORA_OPTIONS)
ConfigT = TypeVar("ConfigT", bound=Config)

#: `plainformer eval`'s computation for a family: (the parsed flags, the run directory, the checkpoint
#: directory, the run's recipe.yaml values) -> metrics.
Evaluator = Callable[[argparse.Namespace, Path, Path, dict[str, Any]], dict[str, Any]]
#: Writes a model of the family (and its tokenizer) as a Hugging Face directory.
Exporter = Callable[[nn.Module, Path, Any], None]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family, as checkpoints name it (config.json's "family").

    data_fields: config fields the data decides (vocabulary sizes, special ids), never flags.
    options: the data and run options of its recipes (`plainformer train --data ...`).
    train: trains a resolved `Run` of one of its recipes; None for a family no recipe trains.
    evaluate, eval_options: `plainformer eval` of its checkpoints, and the eval flags that apply.
    finetune_fields: for fine-tuning recipes (whose model comes from `init`), the only model fields
        that may be given.
    from_base: for fine-tuning, the family's model with the weights of a pretrained model's directory
        (its own or a Hugging Face one) and the given config changes, with `.tokenizer`; `head`: the name
        patterns of the parameters a LoRA run trains besides the adapter (a classifier's).
    export: its Hugging Face layout, None when it has none.
    positions: the config field that bounds a text's length; cross_attention: whether `attention`
        plots an encoder-decoder's cross-attention (else self-attention).
    """

    name: str
    model: type[SavedModel]
    config: type[Config]
    data_fields: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    train: Callable[[Run], dict[str, Any]] | None = None
    evaluate: Evaluator | None = None
    eval_options: tuple[str, ...] = ()
    finetune_fields: tuple[str, ...] = ()
    from_base: Callable[[Path, Mapping[str, Any]], SavedModel] | None = None
    head: tuple[str, ...] = ()
    export: Exporter | None = None
    positions: str = "max_len"
    cross_attention: bool = False

    def __post_init__(self) -> None:
        fields = {field.name for field in dataclasses.fields(self.config)}
        unknown = sorted({*self.data_fields, *self.finetune_fields, self.positions} - fields)
        if unknown:
            raise ValueError(f"family {self.name!r}: {', '.join(unknown)} are not fields of {self.config.__name__}")
        if self.model.family != self.name or self.model.config_class is not self.config:
            raise ValueError(f"family {self.name!r}: {self.model.__name__} names family {self.model.family!r} "
                             f"and config {self.model.config_class.__name__}")


def plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` as YAML writes and reads them back: paths as strings, tuples as lists."""
    return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
            for k, v in values.items()}


@dataclasses.dataclass
class Run:
    """A resolved recipe, ready to train: the family's `train` fills the data-decided model fields.
    `model` is None for a fresh fine-tuning run (the model comes from options["init"], with
    `model_overrides`); `checkpoint` is the verified OUT/last of a resumed run."""

    preset: str
    spec: Family
    model: Config | None
    train: TrainConfig
    options: dict[str, Any]
    out: Path
    checkpoint: Checkpoint | None
    progress: bool
    model_overrides: dict[str, Any]
    shape_note: str | None = None  # the shape chosen for this machine, logged once training starts
    fine_tuning: bool = False

    @property
    def family(self) -> str:
        return self.spec.name

    @property
    def resume(self) -> bool:
        return self.checkpoint is not None

    def model_config(self, config_cls: type[ConfigT]) -> ConfigT:
        """`model` as the family's config class."""
        assert isinstance(self.model, config_cls), f"a {self.family} run holds {type(self.model).__name__}"
        return self.model

    def recipe_values(self) -> dict[str, Any]:
        """What OUT/recipe.yaml holds: every key a flag, so that `train --config` reads it back."""
        if self.fine_tuning:  # the shape is --init's
            model = dict(self.model_overrides)
        else:
            assert self.model is not None  # only a fine-tuning recipe leaves the model to --init
            model = {k: v for k, v in self.model.to_dict().items() if k not in self.spec.data_fields}
        options = {name: self.options.get(name) for name in self.spec.options
                   if self.fine_tuning or name not in FINE_TUNING_OPTIONS}
        return plain({"preset": self.preset, **options, **model, **self.train.to_dict()})

    def write_recipe(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / RECIPE_FILE
        text = (f"# plainformer train --config {path} repeats this run (flags given with it win)\n"
                + yaml.safe_dump(self.recipe_values(), sort_keys=False))
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
        return path


def checkpoint_dir(path: Path) -> Path:
    """A checkpoint directory, or a run directory holding best/ (preferred) or last/; of each, the
    copy an interrupted save left when only that is there (as `load_checkpoint` finds it)."""
    for candidate in (path / "best", path / "last"):
        found = find_checkpoint(candidate)
        if found is not None:
            if found != candidate:
                log(f"plainformer: {candidate} is missing; loading {found}, left by a save that was interrupted")
            return found
    return path


def refuse_non_model(path: Path) -> None:
    """A ValueError for a directory that holds no plainformer checkpoint and no Hugging Face model, saying
    what its config.json lacks if it has one; nothing for any other path (a checkpoint, or one to be found
    by `load_checkpoint`, which names what is missing)."""
    if not path.is_dir() or (path / MANIFEST).is_file() or is_hf_directory(path):
        return
    config = path / "config.json"
    if config.is_file():
        read_json_object(config, what="a Hugging Face config (JSON)")  # names what is wrong with it
        raise ValueError(f"{config} has no model_type: not a Hugging Face model (and {path} holds no "
                         "plainformer checkpoint: manifest.json is missing)")
    raise ValueError(f"{path} holds neither a plainformer checkpoint or run (manifest.json, best/, last/) nor "
                     "a Hugging Face model (config.json)")


def run_and_checkpoint(path: Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) from a run directory (its best/, else last/) or a
    checkpoint directory inside one."""
    checkpoint = checkpoint_dir(path)
    return (path if checkpoint != path else path.parent), checkpoint


def fit(run: Run, model: nn.Module, source: Any, tokenizer: Any, train: TrainConfig | None = None,
        adapter: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Train `model` as `run` says, once the data and the model are ready: the recipe is written
    to OUT/recipe.yaml first, so that a run that stops early can still be repeated, and only once the
    run directory is locked, so that a run refused by the lock leaves the owner's recipe alone.
    `adapter`: a LoRA run's record (`Trainer`). The metrics gain the model's parameters, all and trainable."""
    trainer = Trainer(model, source, train or run.train, run.out, tokenizer=tokenizer,
                      resume=run.checkpoint if run.checkpoint is not None else False, progress=run.progress,
                      adapter=adapter)

    def on_locked() -> None:
        if run.shape_note is not None:
            log(run.shape_note)
        log(f"recipe {run.preset} ({run.family}) -> {run.write_recipe()}")

    return {**trainer.fit(on_locked=on_locked), "parameters": sum(p.numel() for p in model.parameters()),
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
