"""`plainformer train` (any family) and `plainformer finetune`: run a recipe of `plainformer.recipes`.

A value comes from, in increasing priority: the recipe named by `--preset`, the `--config FILE`
(YAML or JSON, the keys of the flags: `n_layers: 2` or `n-layers: 2`), the command line. The
resolved recipe is written to OUT/recipe.yaml, so `plainformer train --config OUT/recipe.yaml`
repeats the run. `--resume` continues the run in OUT from its last/ checkpoint and its recipe: the
training options may change (e.g. --max-steps), the model and the data may not.

Every field of the model configs (GPTConfig, BertConfig, TransformerConfig) and of TrainConfig is a
flag with one meaning, the field's; the fields that the data decides (vocabulary sizes, special
token ids, n_labels) are not flags. A flag that does not apply to the recipe's family is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from .. import recipes
from ..checkpoint.format import Checkpoint, load_checkpoint
from ..config import Config, check_field_type
from ..data.seq2seq import TASKS
from ..files.atomic import atomic_path
from ..models.bert import BertConfig
from ..models.gpt import GPTConfig
from ..models.transformer import TransformerConfig
from ..training.config import TrainConfig
from ..training.distributed import current_launch
from ..training.precision import matmul_rate, resolve_dtype
from ..training.trainer import Trainer
from . import UserError, add_config_arguments, field_type, log, positive_int, set_threads, utf8_text

RECIPE_FILE = "recipe.yaml"
ConfigT = TypeVar("ConfigT", bound=Config)

MODEL_CONFIGS: Mapping[str, type[Config]] = {
    "gpt": GPTConfig, "bert-mlm": BertConfig, "bert-cls": BertConfig, "transformer": TransformerConfig}
# Fields the data decides: set from the tokenizer or the task, never given.
DATA_FIELDS: Mapping[type[Config], tuple[str, ...]] = {
    GPTConfig: ("vocab_size",),
    BertConfig: ("vocab_size", "n_labels", "pad_id"),
    TransformerConfig: ("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id"),
}
# Fine-tuning keeps the shape of the pretrained model: only these fields may change.
FINETUNE_FIELDS = ("dropout", "attention_dropout")


@dataclasses.dataclass(frozen=True)
class Option:
    """A data or run option of some families: its argparse keywords and the families it applies to."""

    families: tuple[str, ...]
    flag: Mapping[str, Any]


OPTIONS: Mapping[str, Option] = {
    "data": Option(("gpt", "bert-mlm"), dict(metavar="DATA", help=(
        "text file (documents between two blank lines), .gz, folder, glob or .jsonl[.gz] "
        "(default: the bundled Shakespeare)"))),
    "val_data": Option(("gpt",), dict(metavar="DATA", help=(
        "held-out validation data, in any form --data takes (default: the end of --data)"))),
    "text_field": Option(("gpt",), dict(metavar="NAME", help="the text field of JSON Lines records "
                                                              "(default: text)")),
    "tokenizer": Option(("gpt",), dict(choices=("char", "bpe"), help="char or byte-level bpe")),
    "vocab_size": Option(("gpt", "bert-mlm"), dict(
        type=positive_int, metavar="INT", help="vocabulary of the tokenizer to train (bpe: default 2048; "
                                      "wordpiece); the model's vocab_size is the tokenizer's")),
    "seq_len": Option(("bert-mlm", "bert-cls"), dict(type=positive_int, metavar="INT",
                      help="tokens per example (a window of text, a line)")),
    "task": Option(("transformer",), dict(choices=list(TASKS), help="built-in sequence-to-sequence task")),
    "init": Option(("bert-cls",), dict(metavar="MODEL", help=(
        "model to fine-tune: minilm, a Hugging Face BERT directory, or a plainformer BERT checkpoint "
        "or run directory (e.g. runs/bert-pretrain)"))),
    "plays": Option(("bert-cls",), dict(nargs="+", metavar="TITLE",
                    help="two or more titles from corpus/works.tsv")),
    "threads": Option(recipes.FAMILIES, dict(type=positive_int, metavar="INT",
                      help="torch.set_num_threads (default: the recipe's, else torch's)")),
}
# Options that may change on --resume: how to run, not what.
RUN_OPTIONS = ("threads",)


@dataclasses.dataclass
class Run:
    """A resolved recipe, ready to train: the family code fills the data-decided model fields.
    `model` is None for fine-tuning (the model comes from options["init"], with `model_overrides`)."""

    preset: str
    family: str
    model: Config | None
    train: TrainConfig
    options: dict[str, Any]
    out: Path
    checkpoint: Checkpoint | None
    progress: bool
    model_overrides: dict[str, Any]
    shape_note: str | None = None  # the shape chosen for this machine, logged once training starts

    @property
    def resume(self) -> bool:
        return self.checkpoint is not None

    def model_config(self, config_cls: type[ConfigT]) -> ConfigT:
        """`model` as the family's config class, which the family code names (MODEL_CONFIGS)."""
        assert isinstance(self.model, config_cls), f"a {self.family} run holds {type(self.model).__name__}"
        return self.model

    def recipe_values(self) -> dict[str, Any]:
        """What OUT/recipe.yaml holds: every key a flag, so that --config reads it back."""
        if recipes.get(self.preset).model is None:  # fine-tuned: the shape is --init's
            model = dict(self.model_overrides)
        else:
            assert self.model is not None  # only a fine-tuning recipe leaves the model to --init
            skip = DATA_FIELDS[type(self.model)]
            model = {k: v for k, v in self.model.to_dict().items() if k not in skip}
        options = {name: self.options.get(name) for name, option in OPTIONS.items()
                   if self.family in option.families}
        return _plain({"preset": self.preset, **options, **model, **self.train.to_dict()})


# ----------------------------------------------------------------------------- arguments

def _model_fields() -> dict[str, list[type[Config]]]:
    """Flag name -> the model configs that have that field (not decided by the data)."""
    owners: dict[str, list[type[Config]]] = {}
    for config_cls in dict.fromkeys(MODEL_CONFIGS.values()):
        for field in dataclasses.fields(config_cls):
            if field.name not in DATA_FIELDS[config_cls] and field.name not in OPTIONS:
                owners.setdefault(field.name, []).append(config_cls)
    return owners


def add_train_arguments(parser: argparse.ArgumentParser, *, default_preset: str,
                        families: tuple[str, ...] = recipes.FAMILIES) -> None:
    parser.add_argument("--preset", metavar="NAME", help=(
        f"the recipe (model and training) of plainformer.recipes: {', '.join(recipes.names())} "
        f"(default: {default_preset})"))
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="YAML or JSON file of flag values (e.g. a run's recipe.yaml); flags win")
    parser.add_argument("--out", type=Path, help="run directory (default: runs/PRESET)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last exactly")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--nproc", type=positive_int, metavar="N", help=(
        "train on N processes of this machine: starts `torchrun --standalone --nproc-per-node N` "
        "(several machines: run torchrun yourself, see the README)"))
    options = parser.add_argument_group("data and run options (each applies to the families named)")
    for name, option in OPTIONS.items():
        options.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                             **{**option.flag, "help": f"{option.flag['help']} [{', '.join(option.families)}]"})
    owners = _model_fields()
    model = parser.add_argument_group("model: config fields (each applies to the configs named)")
    seen: set[str] = set()
    for config_cls in dict.fromkeys(MODEL_CONFIGS.values()):
        seen |= set(add_config_arguments(
            model, config_cls, skip=seen | set(DATA_FIELDS[config_cls]) | set(OPTIONS),
            help=lambda name: "[" + ", ".join(c.__name__ for c in owners[name]) + "]"))
    add_config_arguments(parser, TrainConfig, title="training: TrainConfig fields")
    parser.set_defaults(run=lambda args: run_train(args, default_preset, families))


def recipe_keys() -> set[str]:
    return {"preset", "out", *OPTIONS, *_model_fields(), *(f.name for f in dataclasses.fields(TrainConfig))}


def register(subcommands: argparse._SubParsersAction) -> None:
    epilog = "presets:\n" + "\n".join(f"  {name:22s} {recipe.family:12s} {recipe.summary}"
                                      for name, recipe in recipes.RECIPES.items())
    train = subcommands.add_parser(
        "train", help="train any model family from a recipe (--preset)", epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train the recipe named by --preset (default: `default`, a GPT on the bundled "
                    "Shakespeare in about 5 minutes on 2 cores, into ./runs/default). Ends with one "
                    "JSON line of metrics.")
    add_train_arguments(train, default_preset="default")
    finetune = subcommands.add_parser(
        "finetune", help="fine-tune a pretrained BERT (--init) to classify lines", epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="`train` for fine-tuning recipes (default: bert-finetune): which of --plays a line "
                    "of dialogue comes from; reports validation accuracy against the majority class.")
    add_train_arguments(finetune, default_preset="bert-finetune", families=("bert-cls",))


# ----------------------------------------------------------------------------- config files

def read_config_file(path: Path) -> dict[str, Any]:
    """The values of a YAML or JSON file of flags, keys normalised to field names (n-layers -> n_layers)."""
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    text = utf8_text(path.read_bytes(), str(path))
    if path.suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"{path} is not valid JSON: {error}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise UserError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    else:
        raise UserError(f"--config must be a .yaml, .yml or .json file, got {path}")
    if not isinstance(values, dict):
        raise UserError(f"{path} must hold a mapping of flag names to values, got {type(values).__name__}")
    values = {str(key).replace("-", "_"): value for key, value in values.items()}
    known = recipe_keys()
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"unknown key {key!r} in {path}{hint}; the keys are the flags of "
                            "`plainformer train --help`")
    return {key: _typed(key, value, path) for key, value in values.items() if value is not None}


def _typed(key: str, value: Any, path: Path) -> Any:
    """A file's value as the flag would parse it: paths from strings, numbers from strings such as
    1e-3 (which YAML reads as a string), each of the flag's type, choices checked."""
    kind = _flag_type(key)
    if key in OPTIONS and kind is not None:  # an option's own type checks its range too
        try:
            return kind(str(value))
        except argparse.ArgumentTypeError as error:
            raise UserError(f"{key} in {path}: {error}") from None
    if isinstance(value, str) and kind in (int, float, Path):
        try:
            value = kind(value)
        except ValueError:
            raise UserError(f"{key} in {path} must be {kind.__name__}, got {value!r}") from None
    try:
        _check_type(f"{key} in {path}", key, value, kind)
    except (TypeError, ValueError) as error:
        raise UserError(str(error)) from None
    choices = OPTIONS[key].flag.get("choices") if key in OPTIONS else None
    if choices is not None and value not in choices:
        raise UserError(f"{key} in {path} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _check_type(name: str, key: str, value: Any, kind: type | None) -> None:
    """`value` is what flag `key` parses to: a list of str for --plays, a path, a config field's
    scalar, else a str; `name` says where it comes from in the message."""
    if key in OPTIONS and OPTIONS[key].flag.get("nargs") == "+":
        if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
            raise TypeError(f"{name} must be a list of str, got {value!r}")
    elif kind is Path:
        if not isinstance(value, Path):
            raise TypeError(f"{name} must be a path (a str), got {value!r}")
    elif kind in (bool, int, float):
        check_field_type(name, value, kind)
    elif not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r}")


def _flag_type(key: str) -> type | None:
    if key in OPTIONS:
        return OPTIONS[key].flag.get("type")
    if key == "out":
        return Path
    for config_cls in (*dict.fromkeys(MODEL_CONFIGS.values()), TrainConfig):
        if key in {f.name for f in dataclasses.fields(config_cls)}:
            return field_type(config_cls, key)
    return None


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
            for k, v in values.items()}


def write_recipe(run: Run) -> Path:
    import yaml

    run.out.mkdir(parents=True, exist_ok=True)
    path = run.out / RECIPE_FILE
    text = (f"# plainformer train --config {path} repeats this run (flags given with it win)\n"
            + yaml.safe_dump(run.recipe_values(), sort_keys=False))
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def read_run_recipe(run_dir: Path) -> dict[str, Any]:
    """The recipe a run directory was trained with ({} when it has none)."""
    path = run_dir / RECIPE_FILE
    return read_config_file(path) if path.is_file() else {}


# ----------------------------------------------------------------------------- resolving

def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe values given: the --config file's, then the command line's over them."""
    values = read_config_file(args.config) if args.config is not None else {}
    for key in recipe_keys():
        if getattr(args, key, None) is not None:
            values[key] = getattr(args, key)
    return values


def _check_applicable(given: Mapping[str, Any], family: str, preset: str) -> None:
    config_cls = MODEL_CONFIGS[family]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for key in given:
        if key in OPTIONS and family not in OPTIONS[key].families:
            raise UserError(f"--{key.replace('_', '-')} applies to {', '.join(OPTIONS[key].families)} "
                            f"recipes, not to {preset!r} ({family})")
        if key in _model_fields() and key not in fields:
            raise UserError(f"--{key.replace('_', '-')} is not a field of {config_cls.__name__}, the "
                            f"model of {preset!r}")


def _split(given: Mapping[str, Any], family: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model fields, TrainConfig fields, options) among the given values."""
    model_fields = {f.name for f in dataclasses.fields(MODEL_CONFIGS[family])}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model = {k: v for k, v in given.items() if k in model_fields and k not in OPTIONS}
    train = {k: v for k, v in given.items() if k in train_fields}
    options = {k: v for k, v in given.items() if k in OPTIONS}
    return model, train, options


def refuse_changes(what: str, saved: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """--resume continues the saved run: a given value that differs from the saved one is an error."""
    changed = sorted(k for k, v in given.items() if k in saved and _plain({k: saved[k]}) != _plain({k: v}))
    if changed:
        raise UserError(f"--resume continues the saved {what}, whose {', '.join(changed)} differ from "
                        "the values given; drop those options")


def _tie_schedule(train: dict[str, Any], given_train: Mapping[str, Any], model: Config | None) -> None:
    """The inverse-sqrt schedule's d_model follows the model's unless given."""
    if train["schedule"] == "inverse_sqrt" and "schedule_d_model" not in given_train \
            and model is not None and hasattr(model, "d_model"):
        train["schedule_d_model"] = model.d_model


def resolve(args: argparse.Namespace, default_preset: str,
            families: tuple[str, ...] = recipes.FAMILIES) -> Run:
    """The run that `args` describe: fresh, or resumed from OUT/last (written once for every family)."""
    given = _given(args)
    out = given.pop("out", None) or Path("runs") / given.get("preset", default_preset)
    saved = read_run_recipe(out) if args.resume else {}
    if "preset" in given and "preset" in saved:
        refuse_changes("run", {"preset": saved["preset"]}, {"preset": given["preset"]})
    preset = given.pop("preset", None) or saved.get("preset") or default_preset
    recipe = recipes.get(preset)
    if recipe.family not in families:
        raise UserError(f"preset {preset!r} trains a {recipe.family} model; this command takes "
                        f"{', '.join(recipes.names(families[0]) if len(families) == 1 else families)}")
    _check_applicable(given, recipe.family, preset)
    model_given, train_given, options_given = _split(given, recipe.family)
    if recipe.model is None and set(model_given) - set(FINETUNE_FIELDS):
        raise UserError(f"fine-tuning keeps the shape of --init; of the model fields only "
                        f"{', '.join(FINETUNE_FIELDS)} may be given, got {', '.join(sorted(model_given))}")
    if args.resume:
        return _resume(args, out, preset, recipe, saved, model_given, train_given, options_given)
    shape_note = None
    if recipe.shapes and not recipe.shape_fields() & {*model_given, *train_given}:
        recipe, shape_note = _shaped_for_this_machine(recipe, train_given)
    model = recipe.model.replace(**model_given) if recipe.model is not None else None
    train = {**recipe.train.to_dict(), **train_given}
    _tie_schedule(train, train_given, model)
    return Run(preset, recipe.family, model, TrainConfig.from_dict(train),
               {**recipe.options, **options_given}, out, None, not args.no_progress, model_given, shape_note)


def _shaped_for_this_machine(recipe: recipes.Recipe, train_given: Mapping[str, Any]) -> tuple[recipes.Recipe, str]:
    """The recipe in the shape for this machine's matmul rate, in the dtype the run will train in (a
    probe of ~0.3 s), and the line that says so; recipe.yaml then holds the shape's fields, so that --config
    and --resume repeat it. The processes of a distributed launch would each measure their own rate, so
    there the first shape, for the fastest machines, is taken without a probe."""
    if current_launch().world_size > 1:
        shape, shaped = recipe.shaped_for(math.inf)
        return shaped, f"shape: {shape.name} (the first of preset {recipe.name!r}'s: every process must build it)"
    assert recipe.model is not None  # a recipe with shapes has a model of its own
    width = getattr(recipe.model, "d_model", None)
    dtype, _ = resolve_dtype(train_given.get("dtype", recipe.train.dtype), "cpu", width)
    gflops = matmul_rate(getattr(torch, dtype), seconds=0.3) / 1e9
    shape, shaped = recipe.shaped_for(gflops)
    return shaped, (f"shape: {shape.name} ({dtype} matmuls at {gflops:.0f} GFLOP/s on this machine; "
                    f"{recipe.name!r} takes it from {shape.min_gflops:g} GFLOP/s)")


def _resume(args: argparse.Namespace, out: Path, preset: str, recipe: recipes.Recipe,
            saved: Mapping[str, Any], model_given: dict[str, Any], train_given: dict[str, Any],
            options_given: dict[str, Any]) -> Run:
    checkpoint = load_checkpoint(out / "last")
    if checkpoint.family != recipe.family:
        raise UserError(f"{out} holds a {checkpoint.family} run, not one of preset {preset!r} "
                        f"({recipe.family})")
    model = checkpoint.config(MODEL_CONFIGS[recipe.family])
    refuse_changes("model", model.to_dict(), model_given)
    options = {**recipe.options, **{k: v for k, v in saved.items() if k in OPTIONS}}
    refuse_changes("run's data", options,
                   {k: v for k, v in options_given.items() if k not in RUN_OPTIONS})
    train = TrainConfig.from_dict({**checkpoint.train_config, **train_given})
    return Run(preset, recipe.family, model, train, {**options, **options_given}, out, checkpoint,
               not args.no_progress, model_given)


# ----------------------------------------------------------------------------- running

def _trainers() -> Mapping[str, Callable[[Run], dict[str, Any]]]:
    from . import bert, gpt, seq2seq

    return {"gpt": gpt.train, "bert-mlm": bert.pretrain, "bert-cls": bert.finetune,
            "transformer": seq2seq.train}


def run_train(args: argparse.Namespace, default_preset: str,
              families: tuple[str, ...] = recipes.FAMILIES) -> dict[str, Any]:
    run = resolve(args, default_preset, families)
    set_threads(run.options.get("threads"))
    return _trainers()[run.family](run)


def fit(run: Run, model: nn.Module, source: Any, tokenizer: Any, train: TrainConfig | None = None
        ) -> dict[str, Any]:
    """Train `model` as `run` says, once the data and the model are ready: the recipe is written
    to OUT/recipe.yaml first, so that a run that stops early can still be repeated, and only once the
    run directory is locked, so that a run refused by the lock leaves the owner's recipe alone."""
    trainer = Trainer(model, source, train or run.train, run.out, tokenizer=tokenizer, resume=run.resume,
                      progress=run.progress)

    def on_locked() -> None:
        if run.shape_note is not None:
            log(run.shape_note)
        log(f"recipe {run.preset} ({run.family}) -> {write_recipe(run)}")

    return trainer.fit(on_locked=on_locked)
