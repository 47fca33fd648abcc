"""`plainformer train` (any family) and `plainformer finetune`: run a recipe of `plainformer.recipes`.

`finetune` runs the fine-tuning recipes, whose model comes from `--init` (default preset: the one for
--init's family, gpt-finetune or bert-finetune); `--lora-r` trains a LoRA adapter instead of every weight.

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import families, recipes
from ..checkpoint.format import load_checkpoint
from ..config import Config, check_field_type
from ..data.seq2seq import TASKS
from ..families.family import FINE_TUNING_OPTIONS, RECIPE_FILE, Family, Run, check_training_memory, plain
from ..families.finetuning import base_family
from ..nn.lora import TARGETS
from ..training.config import TrainConfig
from ..training.distributed import current_launch
from ..training.precision import matmul_rate, resolve_dtype
from . import (
    UserError,
    add_config_arguments,
    add_max_memory_argument,
    field_type,
    positive_float,
    positive_int,
    rate,
    set_threads,
    utf8_text,
)

#: The trained families' model configs, each once.
MODEL_CONFIGS: tuple[type[Config], ...] = tuple(dict.fromkeys(f.config for f in families.trained()))


def option_families(name: str) -> tuple[str, ...]:
    """The families whose recipes take the data or run option `name`."""
    return tuple(f.name for f in families.trained() if name in f.options)


# The data and run options (each applies to the families whose `options` name it): argparse keywords.
OPTIONS: Mapping[str, Mapping[str, Any]] = {
    "data": dict(metavar="DATA", help=(
        "text file (documents between two blank lines), .gz, folder, glob or .jsonl[.gz] "
        "(default: the bundled Shakespeare)")),
    "val_data": dict(metavar="DATA", help=(
        "held-out validation data, in any form --data takes (default: the end of --data)")),
    "text_field": dict(metavar="NAME", help="the text field of JSON Lines records "
                                                              "(default: text)"),
    "tokenizer": dict(choices=("char", "bpe"), help="char or byte-level bpe"),
    "vocab_size": dict(
        type=positive_int, metavar="INT", help="vocabulary of the tokenizer to train (bpe: default 2048; "
                                      "wordpiece); the model's vocab_size is the tokenizer's"),
    "seq_len": dict(type=positive_int, metavar="INT",
                      help="tokens per example (a window of text, a line)"),
    "task": dict(choices=list(TASKS), help="built-in sequence-to-sequence task"),
    "init": dict(metavar="MODEL", help=(
        "the model to fine-tune: a plainformer checkpoint or run directory (e.g. runs/default), a Hugging "
        "Face GPT-2, Llama or BERT directory, or minilm")),
    "lora_r": dict(type=positive_int, metavar="R", help=(
        "train a rank-R LoRA adapter (the run keeps it and a reference to --init), not every weight")),
    "lora_alpha": dict(type=positive_float, metavar="ALPHA", help="LoRA's α: the update is scaled by α / r "
                                                                  "(default: 16)"),
    "lora_dropout": dict(type=rate, metavar="P", help="dropout on the input of LoRA's A (default: 0)"),
    "lora_targets": dict(metavar="NAMES", help=(
        f"the layers LoRA adapts, comma-separated, of {','.join(TARGETS)} (default: W_q,W_v)")),
    "plays": dict(nargs="+", metavar="TITLE",
                    help="two or more titles from corpus/works.tsv"),
    "threads": dict(type=positive_int, metavar="INT",
                      help="torch.set_num_threads (default: the recipe's, else torch's)"),
}
# Options that may change on --resume: how to run, not what.
RUN_OPTIONS = ("threads",)


# ----------------------------------------------------------------------------- arguments

def data_fields(config_cls: type[Config]) -> set[str]:
    """The fields of `config_cls` that the data decides, for the families built from it."""
    return {name for f in families.trained() if f.config is config_cls for name in f.data_fields}


def _model_fields() -> dict[str, list[type[Config]]]:
    """Flag name -> the model configs that have that field (not decided by the data)."""
    owners: dict[str, list[type[Config]]] = {}
    for config_cls in MODEL_CONFIGS:
        for field in dataclasses.fields(config_cls):
            if field.name not in data_fields(config_cls) and field.name not in OPTIONS:
                owners.setdefault(field.name, []).append(config_cls)
    return owners


def add_train_arguments(parser: argparse.ArgumentParser, *, default_preset: str,
                        fine_tuning: bool = False) -> None:
    """`train`'s flags; `fine_tuning`: the command runs only fine-tuning recipes (`finetune`), by
    default the one for --init's family."""
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
    add_max_memory_argument(parser)
    options = parser.add_argument_group("data and run options (each applies to the families named)")
    for name, flag in OPTIONS.items():
        options.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                             **{**flag, "help": f"{flag['help']} [{', '.join(option_families(name))}]"})
    owners = _model_fields()
    model = parser.add_argument_group("model: config fields (each applies to the configs named)")
    seen: set[str] = set()
    for config_cls in MODEL_CONFIGS:
        seen |= set(add_config_arguments(
            model, config_cls, skip=seen | data_fields(config_cls) | set(OPTIONS),
            help=lambda name: "[" + ", ".join(c.__name__ for c in owners[name]) + "]"))
    add_config_arguments(parser, TrainConfig, title="training: TrainConfig fields")
    parser.set_defaults(run=lambda args: run_train(args, default_preset, fine_tuning))


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
        "finetune", help="fine-tune a pretrained model (--init), whole or with LoRA (--lora-r)", epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="`train` for the fine-tuning recipes, by default the one for --init's family: "
                    "gpt-finetune (a GPT on your --data text) or bert-finetune (a BERT, default MiniLM, "
                    "classifying which of --plays a line of dialogue comes from). --lora-r R trains a "
                    "rank-R LoRA adapter, kept in the run with a reference to --init (path and sha256), "
                    "instead of every weight. Ends with one JSON line of metrics.")
    add_train_arguments(finetune, default_preset="bert-finetune", fine_tuning=True)


# ----------------------------------------------------------------------------- config files

def read_config_file(path: Path) -> dict[str, Any]:
    """The values of a YAML or JSON file of flags, keys normalised to field names (n-layers -> n_layers)."""
    if not path.exists():
        raise UserError(f"config file not found: {path}")
    if not path.is_file():
        raise UserError(f"--config {path} is not a regular file (a YAML or JSON file of flags)")
    text = utf8_text(path.read_bytes(), str(path))
    if path.suffix == ".json":
        try:
            values = json.loads(text, object_pairs_hook=_unique_pairs)
        except RecursionError:
            raise UserError(f"{path} is not valid JSON: it nests too deeply to read") from None
        except ValueError as error:  # json.JSONDecodeError, or a key given twice
            raise UserError(f"{path} is not valid JSON: {error}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            values = yaml.load(text, Loader=_unique_keys_loader())  # a SafeLoader
        except RecursionError:
            raise UserError(f"{path} is not valid YAML: it nests too deeply to read") from None
        except yaml.YAMLError as error:
            raise UserError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    else:
        raise UserError(f"--config must be a .yaml, .yml or .json file, got {path}")
    if not isinstance(values, dict):
        raise UserError(f"{path} must hold a mapping of flag names to values, got {type(values).__name__}")
    normalised = [str(key).replace("-", "_") for key in values]
    twice = _first_repeated(sorted(normalised))
    if twice is not None:
        raise UserError(f"{path} gives {twice} twice (as {twice} and {twice.replace('_', '-')}?)")
    values = dict(zip(normalised, values.values(), strict=True))
    known = recipe_keys()
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"unknown key {key!r} in {path}{hint}; the keys are the flags of "
                            "`plainformer train --help`")
    return {key: _typed(key, value, path) for key, value in values.items() if value is not None}


def _first_repeated(keys: list[Any]) -> Any:
    """The first of `keys` that occurs more than once, or None (by equality: a YAML key may be a list)."""
    return next((key for key in keys if keys.count(key) > 1), None)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json.loads keeps the last of a repeated key)."""
    twice = _first_repeated([key for key, _ in pairs])
    if twice is not None:
        raise ValueError(f"the key {twice!r} is given twice")
    return dict(pairs)


def _unique_keys_loader() -> type:
    """yaml.SafeLoader refusing a key given twice in a mapping (it keeps the last one silently)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            twice = _first_repeated([self.construct_object(key, deep=deep) for key, _ in node.value])
            if twice is not None:
                raise yaml.constructor.ConstructorError(None, None, f"the key {twice!r} is given twice",
                                                        node.start_mark)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeys


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
    choices = OPTIONS[key].get("choices") if key in OPTIONS else None
    if choices is not None and value not in choices:
        raise UserError(f"{key} in {path} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _check_type(name: str, key: str, value: Any, kind: type | None) -> None:
    """`value` is what flag `key` parses to: a list of str for --plays, a path, a config field's
    scalar, else a str; `name` says where it comes from in the message."""
    if key in OPTIONS and OPTIONS[key].get("nargs") == "+":
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
        return OPTIONS[key].get("type")
    if key == "out":
        return Path
    for config_cls in (*MODEL_CONFIGS, TrainConfig):
        if key in {f.name for f in dataclasses.fields(config_cls)}:
            return field_type(config_cls, key)
    return None


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


def _check_applicable(given: Mapping[str, Any], family: Family, preset: str, fine_tuning: bool) -> None:
    fields = {f.name for f in dataclasses.fields(family.config)}
    for key in given:
        if key in OPTIONS and key not in family.options:
            raise UserError(f"--{key.replace('_', '-')} applies to {', '.join(option_families(key))} "
                            f"recipes, not to {preset!r} ({family.name})")
        if key in FINE_TUNING_OPTIONS and not fine_tuning:
            raise UserError(f"--{key.replace('_', '-')} applies to the fine-tuning recipes "
                            f"({', '.join(fine_tuning_recipes())}), not to {preset!r}, which trains from scratch")
        if key in ("tokenizer", "vocab_size") and fine_tuning:
            raise UserError(f"--{key.replace('_', '-')} does not apply to fine-tuning ({preset!r}): the "
                            "tokenizer is --init's")
        if key in _model_fields() and key not in fields:
            raise UserError(f"--{key.replace('_', '-')} is not a field of {family.config.__name__}, the "
                            f"model of {preset!r}")


def _split(given: Mapping[str, Any], family: Family) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model fields, TrainConfig fields, options) among the given values."""
    model_fields = {f.name for f in dataclasses.fields(family.config)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model = {k: v for k, v in given.items() if k in model_fields and k not in OPTIONS}
    train = {k: v for k, v in given.items() if k in train_fields}
    options = {k: v for k, v in given.items() if k in OPTIONS}
    return model, train, options


def refuse_changes(what: str, saved: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """--resume continues the saved run: a given value that differs from the saved one is an error."""
    changed = sorted(k for k, v in given.items() if k in saved and plain({k: saved[k]}) != plain({k: v}))
    if changed:
        raise UserError(f"--resume continues the saved {what}, whose {', '.join(changed)} differ from "
                        "the values given; drop those options")


def _tie_schedule(train: dict[str, Any], given_train: Mapping[str, Any], model: Config | None) -> None:
    """The inverse-sqrt schedule's d_model follows the model's unless given."""
    if train["schedule"] == "inverse_sqrt" and "schedule_d_model" not in given_train \
            and model is not None and hasattr(model, "d_model"):
        train["schedule_d_model"] = model.d_model


def fine_tuning_recipes() -> list[str]:
    return [name for name, recipe in recipes.RECIPES.items() if recipe.model is None]


def _fine_tuning_preset(init: Any, default_preset: str) -> str:
    """finetune's default recipe: the first fine-tuning recipe of --init's family."""
    if not isinstance(init, str):
        return default_preset
    family = base_family(init)
    found = [name for name in fine_tuning_recipes() if recipes.get(name).family.startswith(family)]
    if not found:
        raise UserError(f"--init {init} holds a {family} model, which no fine-tuning recipe takes "
                        f"({', '.join(fine_tuning_recipes())})")
    return found[0]


def resolve(args: argparse.Namespace, default_preset: str, fine_tuning: bool = False) -> Run:
    """The run that `args` describe: fresh, or resumed from OUT/last (written once for every family)."""
    given = _given(args)
    for key in ("data", "val_data"):
        if isinstance(given.get(key), str) and not given[key].strip():
            raise UserError(f"--{key.replace('_', '-')} must name a file, folder or glob, got {given[key]!r}")
    if fine_tuning and "preset" not in given and not args.resume:
        given["preset"] = _fine_tuning_preset(given.get("init"), default_preset)
    out = given.pop("out", None) or Path("runs") / given.get("preset", default_preset)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a run directory")
    saved = read_run_recipe(out) if args.resume else {}
    if "preset" in given and "preset" in saved:
        refuse_changes("run", {"preset": saved["preset"]}, {"preset": given["preset"]})
    preset = given.pop("preset", None) or saved.get("preset") or default_preset
    recipe = recipes.get(preset)
    if fine_tuning and recipe.model is not None:
        raise UserError(f"preset {preset!r} trains a {recipe.family} model from scratch; finetune takes "
                        f"{', '.join(fine_tuning_recipes())} (or use plainformer train)")
    family = families.get(recipe.family)
    _check_applicable(given, family, preset, recipe.model is None)
    if recipe.model is None and not args.resume and not (given.get("init") or recipe.options.get("init")):
        raise UserError(f"preset {preset!r} fine-tunes the model of --init MODEL: give it")
    model_given, train_given, options_given = _split(given, family)
    if recipe.model is None and set(model_given) - set(family.finetune_fields):
        raise UserError(f"fine-tuning keeps the shape of --init; of the model fields only "
                        f"{', '.join(family.finetune_fields)} may be given, got {', '.join(sorted(model_given))}")
    if args.resume:
        return _resume(args, out, preset, recipe, family, saved, model_given, train_given, options_given)
    shape_note = None
    if recipe.shapes and not recipe.shape_fields() & {*model_given, *train_given}:
        recipe, shape_note = _shaped_for_this_machine(recipe, train_given)
    model = recipe.model.replace(**model_given) if recipe.model is not None else None
    train = {**recipe.train.to_dict(), **train_given}
    _tie_schedule(train, train_given, model)
    return Run(preset, family, model, TrainConfig.from_dict(train), {**recipe.options, **options_given}, out,
               None, not args.no_progress, model_given, shape_note, fine_tuning=recipe.model is None)


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
                    f"{recipe.name!r} takes it {recipe.rates_taking(shape)})")


def _resume(args: argparse.Namespace, out: Path, preset: str, recipe: recipes.Recipe, family: Family,
            saved: Mapping[str, Any], model_given: dict[str, Any], train_given: dict[str, Any],
            options_given: dict[str, Any]) -> Run:
    """The run that continues OUT/last, read and verified here once (the Trainer takes it as it is)."""
    checkpoint = load_checkpoint(out / "last")
    if checkpoint.family != family.name:
        raise UserError(f"{out} holds a {checkpoint.family} run, not one of preset {preset!r} "
                        f"({family.name})")
    model = checkpoint.config(family.config)
    refuse_changes("model", model.to_dict(), model_given)
    options = {**recipe.options, **{k: v for k, v in saved.items() if k in OPTIONS}}
    refuse_changes("run's data", options,
                   {k: v for k, v in options_given.items() if k not in RUN_OPTIONS})
    train = TrainConfig.from_dict({**checkpoint.train_config, **train_given})
    return Run(preset, family, model, train, {**options, **options_given}, out, checkpoint,
               not args.no_progress, model_given, fine_tuning=recipe.model is None)


# ----------------------------------------------------------------------------- running

def run_train(args: argparse.Namespace, default_preset: str, fine_tuning: bool = False) -> dict[str, Any]:
    run = resolve(args, default_preset, fine_tuning)
    check_training_memory(run)  # before any data is prepared or the run directory made
    set_threads(run.options.get("threads"))
    assert run.spec.train is not None  # a recipe's family trains
    return run.spec.train(run)
