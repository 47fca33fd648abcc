"""What a model family is to the rest of the package, and a resolved recipe of one, trained.

A `Family` is registered once (`families/__init__.py`): its model and config classes, the config fields
its data decides, the recipe options it takes, how it trains and evaluates, and its Hugging Face export.
The CLI, `eval`, `export`, `attention` and the recipes look a family up by name and keep no table of
their own. A `Run` is a recipe resolved for one run directory; `fit` trains it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from torch import nn

from ..checkpoint.format import MANIFEST, Checkpoint, find_checkpoint
from ..config import Config
from ..files.atomic import atomic_path
from ..files.json_file import read_json_object
from ..hf.directory import is_hf_directory
from ..log import log
from ..memory import check_memory
from ..models.family_model import FamilyModel, check_stored_parameters
from ..nn.lora import LoRAConfig
from ..training.config import TrainConfig
from ..training.evaluation import Selection
from ..training.kernels import chosen_kernels, keep_kernels, run_kernels
from ..training.trainer import Trainer
from .memory_estimates import context_length, held_bytes, training_bytes

RECIPE_FILE = "recipe.yaml"
#: The recipe options of LoRA: "lora_" and each LoRAConfig field but `trainable`, which the family decides.
LORA_OPTIONS = tuple(f"lora_{field.name}" for field in dataclasses.fields(LoRAConfig) if field.name != "trainable")
#: The options only a fine-tuning recipe (whose model comes from --init) takes.
FINE_TUNING_OPTIONS = ("init", *LORA_OPTIONS)
ConfigT = TypeVar("ConfigT", bound=Config)

#: `plainformer eval`'s computation for a family: (the parsed flags, the run directory, the checkpoint
#: directory, the run's recipe.yaml values) -> metrics.
Evaluator = Callable[[argparse.Namespace, Path, Path, dict[str, Any]], dict[str, Any]]
#: Writes a model of the family (and its tokenizer) as a Hugging Face directory.
Exporter = Callable[[nn.Module, Path, Any], None]
#: Writes a model of the family (and its tokenizer) as one GGUF file, its weights of the type named.
GGUFExporter = Callable[[nn.Module, Path, Any, str], None]


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
    export: its Hugging Face layout, None when it has none; gguf: its GGUF file (llama.cpp), likewise.
    positions: the config field that bounds a text's length; cross_attention: whether `attention`
        plots an encoder-decoder's cross-attention (else self-attention).
    """

    name: str
    model: type[FamilyModel]
    config: type[Config]
    data_fields: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    train: Callable[[Run], dict[str, Any]] | None = None
    evaluate: Evaluator | None = None
    eval_options: tuple[str, ...] = ()
    finetune_fields: tuple[str, ...] = ()
    from_base: Callable[[Path, Mapping[str, Any]], FamilyModel] | None = None
    head: tuple[str, ...] = ()
    export: Exporter | None = None
    gguf: GGUFExporter | None = None
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
    family: Family
    model: Config | None
    train_config: TrainConfig
    options: dict[str, Any]
    out: Path
    checkpoint: Checkpoint | None
    progress: bool
    model_overrides: dict[str, Any]
    shape_note: str | None = None  # the shape chosen for this machine, logged once training starts
    fine_tuning: bool = False

    @property
    def family_name(self) -> str:
        return self.family.name

    @property
    def resume(self) -> bool:
        return self.checkpoint is not None

    def model_config(self, config_cls: type[ConfigT]) -> ConfigT:
        """`model` as the family's config class."""
        assert isinstance(self.model, config_cls), f"a {self.family_name} run holds {type(self.model).__name__}"
        return self.model

    def recipe_values(self) -> dict[str, Any]:
        """What OUT/recipe.yaml holds: every key a flag, so that `train --config` reads it back."""
        if self.fine_tuning:  # the shape is --init's
            model = dict(self.model_overrides)
        else:
            assert self.model is not None  # only a fine-tuning recipe leaves the model to --init
            model = {k: v for k, v in self.model.to_dict().items() if k not in self.family.data_fields}
        options = {name: self.options.get(name) for name in self.family.options
                   if self.fine_tuning or name not in FINE_TUNING_OPTIONS}
        return plain({"preset": self.preset, **options, **model, **self.train_config.to_dict()})

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


def run_or_checkpoint_holding(path: Path) -> Path | None:
    """The run or checkpoint directory that `path` is or lies in (the nearest; links followed), else None:
    where an output written by a command would replace or mix with the files a run owns."""
    path = path.resolve()
    return next((folder for folder in (path, *path.parents) if _is_run_or_checkpoint(folder)), None)


def _is_run_or_checkpoint(folder: Path) -> bool:
    return ((folder / MANIFEST).is_file() or (folder / RECIPE_FILE).is_file()
            or any(_holds_manifest(find_checkpoint(folder / name)) for name in ("best", "last")))


def _holds_manifest(folder: Path | None) -> bool:
    return folder is not None and (folder / MANIFEST).is_file()


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


def check_training_memory(run: Run, train: TrainConfig | None = None, model: nn.Module | None = None) -> None:
    """A MemoryBudgetError when training `run` (with `train`, default the run's) would not fit the memory
    available (`memory_estimates.training_bytes`): estimated from the run's model config before the data is
    prepared, with the vocabulary its tokenizer is to be trained to where the data decides it, or from
    `model` once it is built (a fine-tuning run's comes from --init, a LoRA's trains only its adapter)."""
    train = train or run.train_config
    trainable, held = None, 0  # every parameter; nothing built yet
    config: Config
    if model is not None:
        held = held_bytes(model)
        config = cast(Config, model.config)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        trainable = None if trained == sum(p.numel() for p in model.parameters()) else trained
    elif run.model is None:  # fine-tuning: --init's model, checked as it is built, then here by `fit`
        return
    elif run.checkpoint is not None:  # resuming: the model of its config.json is built next
        config = run.model
        check_stored_parameters(run.checkpoint, config)
    else:
        config = _before_the_data(run, run.model)
    seq_len = run.options.get("seq_len")
    tokens = f"{train.batch_size} x {seq_len or context_length(config)}"

    def estimate(model_config: Config, train_config: TrainConfig) -> int:
        return training_bytes(model_config, train_config.batch_size, seq_len=seq_len, optimizer=train_config.optimizer,
                              family=run.family_name, trainable=trainable, eval_batch_size=train_config.eval_batch_size)

    optimizer = {"adamw": "AdamW", "muon": "Muon"}.get(train.optimizer, train.optimizer)
    check_memory(f"training needs ~{{needed}} (the model, its gradients, {optimizer}'s state and the "
                 f"activations of a batch of {tokens} tokens)", estimate, config, train, held=held)


def _before_the_data(run: Run, config: Config) -> Config:
    """`config` with the vocabulary sizes the data decides as far as they are known before it is read: the
    size a trained tokenizer is asked for (--vocab-size), else 0, so that the estimate is a lower bound
    until `fit` checks the model built. A copy left unchecked, as a size of 0 is no valid config."""
    config = copy.copy(config)
    trained = run.options.get("tokenizer") != "char"  # a char tokenizer's size is the text's characters
    for name in (field for field in run.family.data_fields if field.endswith("vocab_size")):
        given = run.options.get("vocab_size") if trained and name == "vocab_size" else None
        setattr(config, name, given or 0)
    return config


def fit(run: Run, model: nn.Module, source: Any, tokenizer: Any, train: TrainConfig | None = None,
        adapter: Mapping[str, Any] | None = None, selection: Selection | None = None) -> dict[str, Any]:
    """Train `model` as `run` says, once the data and the model are ready: the memory it needs is checked
    first (`check_training_memory`); a float32 run's linear layers then multiply on the kernels measured
    faster here, or on those the run kept when it resumes (`training.kernels`), applied to the model for
    the Trainer. The recipe is written to OUT/recipe.yaml and the kernels beside it, so that a run that
    stops early can still be repeated and resumed, and only once the run directory is locked, so that a
    run refused by the lock leaves the owner's files alone. `adapter`: a LoRA run's record (`Trainer`).
    The metrics gain the model's parameters, all and trainable."""
    train = train or run.train_config
    check_training_memory(run, train, model)
    kernels, kernels_note = run_kernels(model, train, source, run.out, run.checkpoint)

    def on_locked() -> None:
        if run.shape_note is not None:
            log(run.shape_note)
        log(f"recipe {run.preset} ({run.family_name}) -> {run.write_recipe()}")
        keep_kernels(run.out, kernels)
        if kernels_note is not None:
            log(kernels_note)

    with chosen_kernels(model, kernels):
        trainer = Trainer(model, source, train, run.out, tokenizer=tokenizer,
                          resume=run.checkpoint if run.checkpoint is not None else False, progress=run.progress,
                          adapter=adapter, selection=selection)
        metrics = trainer.fit(on_locked=on_locked)
    return {**metrics, "parameters": sum(p.numel() for p in model.parameters()),
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
