"""`plainformer train` (any family) and `plainformer finetune`: run a recipe of `plainformer.recipes`.

`finetune` runs the fine-tuning recipes, whose model comes from `--init` (default preset: the one for
--init's family, gpt-finetune or bert-finetune); `--lora-r` trains a LoRA adapter instead of every weight.

A value comes from, in increasing priority: the recipe named by `--preset`, the `--config FILE`
(YAML or JSON, the keys of the flags: `n_layers: 2` or `n-layers: 2`), the command line. The
resolved recipe is written to OUT/recipe.yaml, so `plainformer train --config OUT/recipe.yaml`
repeats the run. `--resume` continues the run in OUT from its last/ checkpoint and its recipe: the
training options may change (e.g. --max-steps), the model and the data may not.

Here: the flags, and what the command line alone knows (the recipe named, the run directory, the saved
recipe.yaml); the config file is read by cli/config_file.py, and the run resolved from plain values by
families/resolve.py.

Every field of the model configs (GPTConfig, BertConfig, TransformerConfig) and of TrainConfig is a
flag with one meaning, the field's; the fields that the data decides (vocabulary sizes, special
token ids, n_labels) are not flags. A flag that does not apply to the recipe's family is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import families, recipes
from ..data.seq2seq import TASKS
from ..families.family import RECIPE_FILE, Run, check_training_memory, run_or_checkpoint_holding
from ..families.finetuning import base_family
from ..families.resolve import (
    RECIPE_OPTIONS,
    check_data_paths,
    data_fields,
    model_configs,
    model_fields,
    option_families,
    refuse_changes,
    resolve_run,
)
from ..launch import process_seconds
from ..log import log
from ..nn.lora import TARGETS, LoRAConfig
from ..training.config import TrainConfig
from . import (
    UserError,
    add_config_arguments,
    add_max_memory_argument,
    check_output_path,
    config_file,
    field_type,
    positive_int,
    ranged_field_type,
    set_threads,
)

# The flags of the data and run options (families/resolve.py's RECIPE_OPTIONS, which the families' `options`
# name): argparse keywords, in the order of the help; the LoRA flags take LoRAConfig's ranges.
_OPTION_FLAGS: Mapping[str, Mapping[str, Any]] = {
    "data": dict(metavar="DATA", help=(
        "text file (documents between two blank lines), .gz, folder, glob or .jsonl[.gz] "
        "(default: the bundled Shakespeare); translation: PREFIX of PREFIX.SRC and PREFIX.TGT (plain or .gz), "
        "a two-column .tsv or a .jsonl of {\"translation\": {SRC: ..., TGT: ...}}; a classifier's: labelled "
        ".tsv, .csv or .jsonl[.gz]")),
    "val_data": dict(metavar="DATA", help=(
        "held-out validation data, in any form --data takes (default: the end of --data; a classifier's: "
        "a stratified 10%% of it; translation needs it)")),
    "source_lang": dict(metavar="LANG", help="translation: the source language, as the data names it (de)"),
    "target_lang": dict(metavar="LANG", help="translation: the target language, as the data names it (en)"),
    "batch_tokens": dict(type=positive_int, metavar="INT", help=(
        "batches of sentences of similar length holding at most INT tokens a side, padding included (the "
        "paper's batching), and at most --batch-size sentences")),
    "text_field": dict(metavar="NAME", help="the text field of JSON Lines records or a labelled file's header "
                                            "(default: text; a classifier's: sentence, else text)"),
    "text_pair_field": dict(metavar="NAME", help="a labelled file's second text, for sentence pairs (default: none)"),
    "label_field": dict(metavar="NAME", help="a labelled file's label field (default: label)"),
    "tokenizer": dict(choices=("char", "bpe"), help="char or byte-level bpe"),
    "vocab_size": dict(
        type=positive_int, metavar="INT", help="vocabulary of the tokenizer to train (bpe: default 2048; "
                                      "wordpiece; translation: SentencePiece, default 8000); the model's "
                                      "vocab_size is the tokenizer's"),
    "seq_len": dict(type=positive_int, metavar="INT",
                      help="tokens per example (a window of text, a line)"),
    "task": dict(choices=list(TASKS), help="built-in sequence-to-sequence task"),
    "init": dict(metavar="MODEL", help=(
        "the model to fine-tune: a plainformer checkpoint or run directory (e.g. runs/default), a Hugging "
        "Face GPT-2, Llama or BERT directory, or minilm")),
    "lora_r": dict(type=ranged_field_type(LoRAConfig, "r"), metavar="R", help=(
        "train a rank-R LoRA adapter (the run keeps it and a reference to --init), not every weight")),
    "lora_alpha": dict(type=ranged_field_type(LoRAConfig, "alpha"), metavar="ALPHA",
                       help="LoRA's α: the update is scaled by α / r (default: 16)"),
    "lora_dropout": dict(type=ranged_field_type(LoRAConfig, "dropout"), metavar="P",
                         help="dropout on the input of LoRA's A (default: 0)"),
    "lora_targets": dict(metavar="NAMES", help=(
        f"the layers LoRA adapts, comma-separated, of {','.join(TARGETS)} (default: W_q,W_v)")),
    "plays": dict(nargs="+", metavar="TITLE",
                    help="two or more titles from corpus/works.tsv"),
    "threads": dict(type=positive_int, metavar="INT",
                      help="torch.set_num_threads (default: the recipe's, else torch's)"),
}
#: The recipe options' flags, in the help's order: a family's option without a flag fails every command at
#: once (ValueError: not in tuple); a flag that no family's option names is left out.
OPTIONS = {name: _OPTION_FLAGS[name] for name in sorted(RECIPE_OPTIONS, key=tuple(_OPTION_FLAGS).index)}


# ----------------------------------------------------------------------------- arguments

def add_train_arguments(parser: argparse.ArgumentParser, *, default_preset: str,
                        fine_tuning: bool = False) -> None:
    """`train`'s flags; `fine_tuning`: the command runs only fine-tuning recipes (`finetune`), by
    default the one for --init's family."""
    parser.add_argument("--preset", metavar="NAME", help=(
        f"the recipe (model and training) of plainformer.recipes: {', '.join(recipes.names())} "
        f"(default: {default_preset})"))
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="YAML or JSON file of flag values (e.g. a run's recipe.yaml); flags win")
    parser.add_argument("--out", type=Path, help=(
        "run directory, which must hold no run unless --resume (default: runs/PRESET, or where that holds a run "
        "the first of runs/PRESET-2, -3, ... that does not)"))
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
    owners = model_fields()
    model = parser.add_argument_group("model: config fields (each applies to the configs named)")
    seen: set[str] = set()
    for config_cls in model_configs():
        seen |= set(add_config_arguments(
            model, config_cls, skip=seen | data_fields(config_cls) | set(OPTIONS),
            help=lambda name: "[" + ", ".join(c.__name__ for c in owners[name]) + "]"))
    add_config_arguments(parser, TrainConfig, title="training: TrainConfig fields")
    parser.set_defaults(run=lambda args: run_train(args, default_preset, fine_tuning))


def recipe_keys() -> set[str]:
    return {"preset", "out", *OPTIONS, *model_fields(), *(f.name for f in dataclasses.fields(TrainConfig))}


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
                    "classifying the texts of your labelled --data, else which of --plays a line of dialogue "
                    "comes from; sst2 is its recipe for SST-2). --lora-r R trains a "
                    "rank-R LoRA adapter, kept in the run with a reference to --init (path and sha256), "
                    "instead of every weight. Ends with one JSON line of metrics.")
    add_train_arguments(finetune, default_preset="bert-finetune", fine_tuning=True)


# ----------------------------------------------------------------------------- config files

def recipe_flags() -> dict[str, Mapping[str, Any]]:
    """Each key of a recipe file (`--config`, OUT/recipe.yaml) -> the argparse keywords of its flag."""
    return {key: {**OPTIONS[key]} if key in OPTIONS else {"type": _flag_type(key)} for key in recipe_keys()}


def _flag_type(key: str) -> type | None:
    if key == "out":
        return Path
    for config_cls in (*model_configs(), TrainConfig):
        if key in {f.name for f in dataclasses.fields(config_cls)}:
            return field_type(config_cls, key)
    return None


def read_config_file(path: Path) -> dict[str, Any]:
    """The values of a YAML or JSON file of `train`'s flags, keys normalised to field names."""
    return config_file.read_config_file(path, recipe_flags(), "plainformer train")


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
    """The run that `args` describe: the recipe and run directory they name, resolved by
    `families.resolve.resolve_run` (fresh, or resumed from OUT/last)."""
    given = _given(args)
    check_data_paths(given)
    if fine_tuning and "preset" not in given and not args.resume:
        given["preset"] = _fine_tuning_preset(given.get("init"), default_preset)
    named = given.pop("out", None)
    out = named or Path("runs") / given.get("preset", default_preset)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a run directory")
    if not args.resume:
        out = _fresh_run_directory(out, named=named is not None)
    saved = read_run_recipe(out) if args.resume else {}
    if "preset" in given and "preset" in saved:
        refuse_changes("run", {"preset": saved["preset"]}, {"preset": given["preset"]})
    preset = given.pop("preset", None) or saved.get("preset") or default_preset
    recipe = recipes.get(preset)
    if fine_tuning and recipe.model is not None:
        raise UserError(f"preset {preset!r} trains a {recipe.family} model from scratch; finetune takes "
                        f"{', '.join(fine_tuning_recipes())} (or use plainformer train)")
    return resolve_run(given, preset=preset, recipe=recipe, family=families.get(recipe.family), out=out,
                       resume=args.resume, saved=saved, progress=not args.no_progress,
                       fine_tuning_recipes=fine_tuning_recipes())


def _fresh_run_directory(out: Path, *, named: bool) -> Path:
    """Where a fresh run trains: `out`, unless a run is there (its recipe.yaml, best/ or last/), which training
    would replace. A --out given (`named`) is then refused; the default runs/PRESET becomes the first of
    runs/PRESET-2, runs/PRESET-3, ... that holds none, so that `plainformer train` run twice keeps both runs."""
    holder = run_or_checkpoint_holding(out)
    if holder is None:
        return out
    if holder != out.resolve():
        check_output_path("--out", out)  # inside a run: refused, naming it
    if named:
        raise UserError(f"--out {out} holds a run or checkpoint already: continue it with --resume, train a new one "
                        f"with another --out, or remove {out} to start over")
    other = next(other for other in (out.with_name(f"{out.name}-{n}") for n in itertools.count(2))
                 if run_or_checkpoint_holding(other) is None)
    log(f"plainformer: {out} holds a run already, kept; this one trains into {other} (--resume continues {out}, "
        "--out DIR names the directory)")
    return other


# ----------------------------------------------------------------------------- running

def run_train(args: argparse.Namespace, default_preset: str, fine_tuning: bool = False) -> dict[str, Any]:
    run = resolve(args, default_preset, fine_tuning)
    check_training_memory(run)  # before any data is prepared or the run directory made
    set_threads(run.options.get("threads"))
    assert run.family.train is not None  # a recipe's family trains
    return with_setup_seconds(run.family.train(run))


def with_setup_seconds(metrics: dict[str, Any]) -> dict[str, Any]:
    """The trainer's metrics with the process's side of its time: seconds["setup"], what the process spent
    outside the training session (imports, data, building the model), and seconds["process"], its wall
    seconds until now (what is left of a run's wall is the exit)."""
    process, seconds = process_seconds(), metrics.get("seconds")
    if process is None or seconds is None:
        return metrics
    return {**metrics, "seconds": {"setup": max(process - sum(seconds.values()), 0.0), **seconds,
                                   "process": process}}
