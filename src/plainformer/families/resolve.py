"""A recipe resolved for one run: the values given (a --config file's and the command line's, as one
dict), checked against the family and split into the model config, the TrainConfig and the options,
over the recipe's own; or, with `resume`, checked against the saved run and continued from OUT/last.

Plain values in, a `Run` out: the command line (cli/train.py) reads the flags, the config file and the
recipe (`plainformer.recipes`, a layer above), and calls `resolve_run`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.format import load_checkpoint
from ..config import Config
from ..errors import UserError
from ..launch import current_launch
from ..training.config import TrainConfig
from ..training.precision import matmul_rate, resolve_dtype
from . import trained
from .family import FINE_TUNING_OPTIONS, Family, Run, plain

#: The data and run options of the recipes, each once: those the trained families' `options` name (the
#: one place they are listed; the command line's flags follow them).
RECIPE_OPTIONS = tuple(dict.fromkeys(name for family in trained() for name in family.options))
#: Options that may change on --resume: how to run, not what.
RUN_OPTIONS = ("threads",)
#: Model fields that one value of another field alone reads: given beside any other (and other than their default,
#: which every recipe.yaml holds), nothing would read them.
READ_ONLY_WITH = {"rope_base": ("pos_encoding", "rope")}


def model_configs() -> tuple[type[Config], ...]:
    """The trained families' model configs, each once."""
    return tuple(dict.fromkeys(f.config for f in trained()))


def option_families(name: str) -> tuple[str, ...]:
    """The families whose recipes take the data or run option `name`."""
    return tuple(f.name for f in trained() if name in f.options)


def data_fields(config_cls: type[Config]) -> set[str]:
    """The fields of `config_cls` that the data decides, for the families built from it."""
    return {name for f in trained() if f.config is config_cls for name in f.data_fields}


def model_fields() -> dict[str, list[type[Config]]]:
    """Model field name -> the model configs that have that field (not decided by the data)."""
    owners: dict[str, list[type[Config]]] = {}
    for config_cls in model_configs():
        for field in dataclasses.fields(config_cls):
            if field.name not in data_fields(config_cls) and field.name not in RECIPE_OPTIONS:
                owners.setdefault(field.name, []).append(config_cls)
    return owners


def options_taken(family: Family, fine_tuning: bool) -> tuple[str, ...]:
    """The data and run options a recipe of `family` takes: --init and LoRA's only when it fine-tunes
    (`fine_tuning`: its model comes from --init), and then not the tokenizer's, which is --init's."""
    refused = ("tokenizer", "vocab_size") if fine_tuning else FINE_TUNING_OPTIONS
    return tuple(name for name in family.options if name not in refused)


def model_fields_taken(family: Family, fine_tuning: bool) -> tuple[str, ...]:
    """The model fields a recipe of `family` takes: when it fine-tunes, the family's `finetune_fields` (the
    shape is --init's); else every field of its config that the data does not decide."""
    if fine_tuning:
        return family.finetune_fields
    return tuple(field.name for field in dataclasses.fields(family.config)
                 if field.name not in family.data_fields and field.name not in RECIPE_OPTIONS)


def refuse_changes(what: str, saved: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """--resume continues the saved run: a given value that differs from the saved one is an error."""
    changed = sorted(k for k, v in given.items() if k in saved and plain({k: saved[k]}) != plain({k: v}))
    if changed:
        raise UserError(f"--resume continues the saved {what}, whose {', '.join(changed)} differ from "
                        "the values given; drop those options")


def check_data_paths(given: Mapping[str, Any]) -> None:
    """--data and --val-data, when given as text, name something."""
    for key in ("data", "val_data"):
        if isinstance(given.get(key), str) and not given[key].strip():
            raise UserError(f"--{key.replace('_', '-')} must name a file, folder or glob, got {given[key]!r}")


def resolve_run(given: Mapping[str, Any], *, preset: str, recipe: Any, family: Family, out: Path,
                resume: bool, saved: Mapping[str, Any], progress: bool,
                fine_tuning_recipes: Sequence[str]) -> Run:
    """The run of `recipe` (a `plainformer.recipes.Recipe`, named `preset`, of `family`) with the `given`
    values (keys: the recipe's, less preset and out; a key given is given, with None too: `--sliding-window none`
    sets the field to None whatever the recipe's value) over its own, into `out`: fresh, or with `resume`
    continued from OUT/last, whose recipe.yaml held `saved`. `fine_tuning_recipes`: the names of the
    recipes whose model comes from --init, for the messages."""
    _check_applicable(given, family, preset, recipe.model is None, fine_tuning_recipes)
    if recipe.model is None and not resume and not (given.get("init") or recipe.options.get("init")):
        raise UserError(f"preset {preset!r} fine-tunes the model of --init MODEL: give it")
    model_given, train_given, options_given = _split(given, family)
    if recipe.model is None and set(model_given) - set(model_fields_taken(family, True)):
        raise UserError(f"fine-tuning keeps the shape of --init; of the model fields only "
                        f"{', '.join(family.finetune_fields)} may be given, got {', '.join(sorted(model_given))}")
    if resume:
        return _resume(out, preset, recipe, family, saved, model_given, train_given, options_given, progress)
    shape_note = None
    if recipe.shapes and not recipe.shape_fields() & {*model_given, *train_given}:
        recipe, shape_note = _shaped_for_this_machine(recipe, train_given)
    model = recipe.model.replace(**model_given) if recipe.model is not None else None
    _refuse_unread(model_given, model)
    train = {**recipe.train.to_dict(), **train_given}
    _tie_schedule(train, train_given, model)
    return Run(preset, family, model, TrainConfig.from_dict(train), {**recipe.options, **options_given}, out,
               None, progress, model_given, shape_note, fine_tuning=recipe.model is None)


def _check_applicable(given: Mapping[str, Any], family: Family, preset: str, fine_tuning: bool,
                      fine_tuning_recipes: Sequence[str]) -> None:
    """A UserError for the first key of `given` that a recipe of `family` takes in no case: an option it does not
    take (`options_taken`), or a field its config lacks. A model field outside a fine-tuning recipe's
    `model_fields_taken` is refused by `resolve_run`, naming all of them."""
    options = options_taken(family, fine_tuning)
    fields = {f.name for f in dataclasses.fields(family.config)}
    for key in given:
        if key in RECIPE_OPTIONS and key not in options:
            if key not in family.options:
                raise UserError(f"--{key.replace('_', '-')} applies to {', '.join(option_families(key))} "
                                f"recipes, not to {preset!r} ({family.name})")
            if key in FINE_TUNING_OPTIONS:
                raise UserError(f"--{key.replace('_', '-')} applies to the fine-tuning recipes "
                                f"({', '.join(fine_tuning_recipes)}), not to {preset!r}, which trains from scratch")
            raise UserError(f"--{key.replace('_', '-')} does not apply to fine-tuning ({preset!r}): the "
                            "tokenizer is --init's")
        if key in model_fields() and key not in fields:
            raise UserError(f"--{key.replace('_', '-')} is not a field of {family.config.__name__}, the "
                            f"model of {preset!r}")


def _refuse_unread(model_given: Mapping[str, Any], model: Config | None) -> None:
    """A UserError for a model field given that the model's other fields leave unread (READ_ONLY_WITH)."""
    defaults = {} if model is None else {f.name: f.default for f in dataclasses.fields(model)}
    for name, (other, value) in READ_ONLY_WITH.items():
        chosen = getattr(model, other, value)
        if name in model_given and model_given[name] != defaults.get(name) and chosen != value:
            raise UserError(f"--{name.replace('_', '-')} is read by --{other.replace('_', '-')} {value} only, not by "
                            f"this run's --{other.replace('_', '-')} {chosen}: drop it")


def _split(given: Mapping[str, Any], family: Family) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model fields, TrainConfig fields, options) among the given values."""
    model_names = {f.name for f in dataclasses.fields(family.config)}
    train_names = {f.name for f in dataclasses.fields(TrainConfig)}
    model = {k: v for k, v in given.items() if k in model_names and k not in RECIPE_OPTIONS}
    train = {k: v for k, v in given.items() if k in train_names}
    options = {k: v for k, v in given.items() if k in RECIPE_OPTIONS}
    return model, train, options


def _tie_schedule(train: dict[str, Any], given_train: Mapping[str, Any], model: Config | None) -> None:
    """The inverse-sqrt schedule's d_model follows the model's unless given."""
    if train["schedule"] == "inverse_sqrt" and "schedule_d_model" not in given_train \
            and model is not None and hasattr(model, "d_model"):
        train["schedule_d_model"] = model.d_model


def _shaped_for_this_machine(recipe: Any, train_given: Mapping[str, Any]) -> tuple[Any, str]:
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


def _resume(out: Path, preset: str, recipe: Any, family: Family, saved: Mapping[str, Any],
            model_given: dict[str, Any], train_given: dict[str, Any], options_given: dict[str, Any],
            progress: bool) -> Run:
    """The run that continues OUT/last, read and verified here once (the Trainer takes it as it is)."""
    checkpoint = load_checkpoint(out / "last")
    if checkpoint.family != family.name:
        raise UserError(f"{out} holds a {checkpoint.family} run, not one of preset {preset!r} "
                        f"({family.name})")
    model = checkpoint.config(family.config)
    refuse_changes("model", model.to_dict(), model_given)
    options = {**recipe.options, **{k: v for k, v in saved.items() if k in RECIPE_OPTIONS}}
    refuse_changes("run's data", options,
                   {k: v for k, v in options_given.items() if k not in RUN_OPTIONS})
    train = TrainConfig.from_dict({**checkpoint.train_config, **train_given})
    return Run(preset, family, model, train, {**options, **options_given}, out, checkpoint,
               progress, model_given, fine_tuning=recipe.model is None)
