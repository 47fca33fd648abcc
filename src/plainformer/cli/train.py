"""`plainformer train` (any family) and `plainformer finetune`: run a recipe of `plainformer.recipes`.

`finetune` runs the fine-tuning recipes, whose model comes from `--init` (default recipe: the one for
--init's family, gpt-finetune or bert-finetune); `--lora-r` trains a LoRA adapter instead of every weight.

A value comes from, in increasing priority: the recipe named by `--recipe` (or `--preset`), the `--config FILE`
(YAML or JSON, the keys of the flags: `n_layers: 2` or `n-layers: 2`), the command line. The
resolved recipe is written to OUT/recipe.yaml, so `plainformer train --config OUT/recipe.yaml`
repeats the run. `--resume` continues the run in OUT from its last/ checkpoint and its recipe: the
training options may change (e.g. --max-steps), the model and the data may not.

Here: the flags, and what the command line alone knows (the recipe named, the run directory, the saved
recipe.yaml); the config file is read by cli/config_file.py, and the run resolved from plain values by
families/resolve.py.

Every field of the model configs (GPTConfig, BertConfig, TransformerConfig) and of TrainConfig is a
flag with one meaning, the field's; the fields that the data decides (vocabulary sizes, special
token ids, n_labels) are not flags. An optional field takes `none` (`--sliding-window none`), which sets
it to None whatever the recipe's value. The verb's parser is made for the recipe: a small parser reads
--recipe (else --config's) first, and the help then lists, in groups, what a recipe of that family takes,
with the recipe's values. Every other recipe flag is still read, unlisted, so that `families/resolve.py`
refuses one that does not apply naming the recipes it applies to.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import shutil
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import families, recipes
from ..config import Config, field_choices
from ..data.classification import DEFAULT_PLAYS
from ..data.seq2seq import TASKS
from ..families.family import (
    FINE_TUNING_OPTIONS,
    RECIPE_FILE,
    Family,
    Run,
    check_training_memory,
    run_or_checkpoint_holding,
)
from ..families.finetuning import base_family
from ..families.resolve import (
    RECIPE_OPTIONS,
    check_data_paths,
    model_configs,
    model_fields,
    model_fields_taken,
    options_taken,
    refuse_changes,
    resolve_run,
)
from ..launch import process_seconds
from ..log import log
from ..nn.lora import TARGETS, LoRAConfig
from ..recipes import Recipe
from ..training.config import TrainConfig
from . import (
    HelpFormatter,
    OrNone,
    UserError,
    _Parser,
    add_max_memory_argument,
    check_output_path,
    config_file,
    config_flag,
    positive_int,
    ranged_field_type,
    set_threads,
)

_LORA = LoRAConfig()  # its defaults

# The flags of the data and run options (families/resolve.py's RECIPE_OPTIONS, which the families' `options`
# name): argparse keywords, in the order of the help, with `help` and `default` (what holds when neither the
# recipe nor the user gives one), each a text or a mapping family -> text; the LoRA flags take LoRAConfig's ranges.
_OPTION_FLAGS: Mapping[str, Mapping[str, Any]] = {
    "init": dict(metavar="MODEL", help={
        "gpt": "the GPT to fine-tune: a plainformer checkpoint or run (runs/default), or a Hugging Face GPT-2, "
               "Llama or Mixtral directory",
        "bert-cls": "the BERT to fine-tune: minilm, a Hugging Face BERT directory, or a plainformer checkpoint "
                    "or run"}),
    "lora_r": dict(type=ranged_field_type(LoRAConfig, "r"), metavar="R", help=(
        "train a rank-R LoRA adapter (kept with a reference to --init) instead of every weight"), default="none"),
    "lora_alpha": dict(type=ranged_field_type(LoRAConfig, "alpha"), metavar="ALPHA",
                       help="LoRA's α: the update is scaled by α / r", default=_LORA.alpha),
    "lora_dropout": dict(type=ranged_field_type(LoRAConfig, "dropout"), metavar="P",
                         help="dropout on the input of LoRA's A", default=_LORA.dropout),
    "lora_targets": dict(metavar="NAMES", help=f"the layers LoRA adapts, comma-separated, of {','.join(TARGETS)}",
                         default=",".join(_LORA.targets)),
    "data": dict(metavar="DATA", help={
        "gpt": "text file (documents between two blank lines), .gz, folder, glob or .jsonl[.gz]",
        "bert-mlm": "a UTF-8 text file",
        "bert-cls": "labelled data: a .tsv, .csv or .jsonl[.gz] of texts and labels",
        "transformer": "parallel data: PREFIX of PREFIX.SRC and PREFIX.TGT (plain or .gz), a two-column .tsv or "
                       "a .jsonl of {\"translation\": {SRC: ..., TGT: ...}}"},
        default={"gpt": "the bundled Shakespeare", "bert-mlm": "the bundled Shakespeare",
                 "bert-cls": "which of --plays a line is from", "transformer": "--task's pairs"}),
    "val_data": dict(metavar="DATA", help="held-out validation data, as --data", default={
        "gpt": "the end of --data", "bert-cls": "a stratified 10% of --data", "transformer": "none; --data needs it"}),
    "source_lang": dict(metavar="LANG", help="the source language, as the data names it"),
    "target_lang": dict(metavar="LANG", help="the target language, as the data names it"),
    "batch_tokens": dict(type=positive_int, metavar="N", help=(
        "batches of sentences of similar length, at most N tokens a side with padding, and at most "
        "--batch-size sentences"), default="--batch-size sentences"),
    "text_field": dict(metavar="NAME", help={"gpt": "the text field of JSON Lines records",
                                             "bert-cls": "the text field of --data"},
                       default={"gpt": "text", "bert-cls": "sentence, else text"}),
    "text_pair_field": dict(metavar="NAME", help="the second text's field of --data, for sentence pairs",
                            default="none"),
    "label_field": dict(metavar="NAME", help="the label field of --data", default="label"),
    "tokenizer": dict(choices=("char", "bpe"), metavar="NAME", help="characters, or byte-level BPE", default="char"),
    "vocab_size": dict(type=positive_int, metavar="N", help={
        "gpt": "the bpe tokenizer's vocabulary, the model's vocab_size",
        "bert-mlm": "the WordPiece tokenizer's vocabulary, trained on --data",
        "transformer": "SentencePiece pieces, shared by both languages"},
        default={"gpt": "2048", "transformer": "8000"}),
    "seq_len": dict(type=positive_int, metavar="N", help={"bert-mlm": "tokens per window of text",
                                                          "bert-cls": "tokens per text, the rest cut off"}),
    "task": dict(choices=list(TASKS), metavar="NAME", help="a built-in task"),
    "plays": dict(nargs="+", metavar="TITLE", help="two or more titles from corpus/works.tsv",
                  default=", ".join(DEFAULT_PLAYS)),
    "threads": dict(type=positive_int, metavar="N", help="torch.set_num_threads", default="torch's"),
}
#: The recipe options' flags, in the help's order: a family's option without a flag fails every command at
#: once (ValueError: not in tuple); a flag that no family's option names is left out.
OPTIONS = {name: _OPTION_FLAGS[name] for name in sorted(RECIPE_OPTIONS, key=tuple(_OPTION_FLAGS).index)}


# ----------------------------------------------------------------------------- the flags

def recipe_keys() -> set[str]:
    """The keys of a recipe, each a flag and a key of a config file: `preset` (`recipe` in a file too), `out`,
    the options, the model fields and the TrainConfig fields."""
    return {"preset", "recipe", "out", *OPTIONS, *model_fields(), *(f.name for f in dataclasses.fields(TrainConfig))}


def recipe_flag(key: str) -> dict[str, Any]:
    """The argparse keywords, all but help, of the flag of `key`, an option or a config field, whatever the
    recipe: a field's flag takes `none` where a config that has the field allows None."""
    if key in OPTIONS:
        return {name: value for name, value in OPTIONS[key].items() if name not in ("help", "default")}
    flags = [config_flag(config_cls, key) for config_cls in (*model_configs(), TrainConfig)
             if key in {field.name for field in dataclasses.fields(config_cls)}]
    return next((flag for flag in flags if isinstance(flag.get("type"), OrNone)), flags[0])


@dataclasses.dataclass(frozen=True)
class Verb:
    """`train`, or `finetune` (`fine_tuning`: it runs only the recipes whose model comes from --init, by
    default the one for --init's family), and the recipe it runs when none is named."""

    name: str
    default_recipe: str
    fine_tuning: bool
    help: str
    description: str
    usage: str


TRAIN = Verb("train", "default", False, "train any model family from a recipe (--recipe)", (
    "Train a recipe of plainformer.recipes: each flag sets one field of its model, training or data over the "
    "recipe's. Ends with one JSON line of metrics."),
    "plainformer train [--recipe NAME] [--config FILE] [--out DIR] [--resume] [--FIELD VALUE ...]")
FINETUNE = Verb("finetune", "bert-finetune", True,
                "fine-tune a pretrained model (--init), whole or with LoRA (--lora-r)", (
    "`train` for the fine-tuning recipes, by default the one for --init's family: gpt-finetune (a GPT on your "
    "--data text) or bert-finetune (a BERT, default MiniLM, classifying the texts of your labelled --data, else "
    "which of --plays a line of dialogue comes from; sst2 is its recipe for SST-2). --lora-r R trains a rank-R "
    "LoRA adapter, kept in the run with a reference to --init (path and sha256), instead of every weight. Ends "
    "with one JSON line of metrics."),
    "plainformer finetune [--init MODEL] [--recipe NAME] [--lora-r R] [--FIELD VALUE ...]")


def register(subcommands: argparse._SubParsersAction) -> None:
    for verb in (TRAIN, FINETUNE):
        parser = subcommands.add_parser(verb.name, help=verb.help, add_help=False)
        parser.build = functools.partial(verb_parser, verb, parser.prog)


def verb_parser(verb: Verb, prog: str, argv: list[str]) -> argparse.ArgumentParser:
    """`verb`'s parser, its help that of the recipe `argv` names (`_shown_recipe`): the flags of every recipe, then
    in groups what a recipe of its family takes, then, unlisted, every other recipe flag."""
    recipe = _shown_recipe(verb, argv)
    family = families.get(recipe.family)
    fine_tuning = recipe.model is None
    shaped = [recipe.shaped_for(shape.min_gflops)[1] for shape in recipe.shapes]  # once, not once a field
    parser = _Parser(prog=prog, usage=verb.usage, formatter_class=_Formatter,
                     description=textwrap.fill(f"{verb.description} {_shown_note(verb, recipe)}", _width(),
                                               break_on_hyphens=False),
                     epilog=_recipes_list())
    _add_run_arguments(parser, verb)
    shown = set()
    taken = options_taken(family, fine_tuning)
    options = parser.add_argument_group("data and run options")
    for key in taken:
        if key not in FINE_TUNING_OPTIONS:
            shown.add(_add(options, key, _option_help(key, family, recipe)))
    if fine_tuning:
        model = parser.add_argument_group(f"the model: --init's, whole or with LoRA; of its {family.config.__name__} "
                                          "fields only these")
        for key in taken:
            if key in FINE_TUNING_OPTIONS:
                shown.add(_add(model, key, _option_help(key, family, recipe)))
        for key in model_fields_taken(family, True):
            shown.add(_add(model, key, _field_help(family.config, key, "default: --init's")))
    else:
        model = parser.add_argument_group(f"model: {family.config.__name__} fields (an optional one takes none)")
        for key in model_fields_taken(family, False):
            shown.add(_add(model, key, _field_help(family.config, key, _recipe_value(recipe, shaped, "model", key))))
    training = parser.add_argument_group("training: TrainConfig fields (an optional one takes none)")
    for field in dataclasses.fields(TrainConfig):
        shown.add(_add(training, field.name, _field_help(TrainConfig, field.name,
                                                          _recipe_value(recipe, shaped, "train", field.name))))
    for key in sorted(recipe_keys() - shown - {"preset", "recipe", "out"}):
        _add(parser, key, argparse.SUPPRESS)  # read, so that the resolution refuses it naming where it applies
    parser.set_defaults(run=lambda args: run_train(args, verb.default_recipe, verb.fine_tuning))
    return parser


def _add_run_arguments(parser: argparse.ArgumentParser, verb: Verb) -> None:
    """The flags of every recipe: which recipe, where its run goes, and how to run it."""
    parser.add_argument("--recipe", "--preset", dest="preset", metavar="NAME", default=argparse.SUPPRESS,
                        help=f"the recipe to run, of those below (default: {verb.default_recipe}"
                             f"{', or the one for --init' if verb.fine_tuning else ''})")
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="YAML or JSON file of flag values (e.g. a run's recipe.yaml); flags win")
    parser.add_argument("--out", type=Path, metavar="DIR", default=argparse.SUPPRESS,
                        help="run directory (default: runs/RECIPE; -2, -3, ... if it holds a run)")
    parser.add_argument("--resume", action="store_true", help="continue the run in OUT from its last/ exactly")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--nproc", type=positive_int, metavar="N",
                        help="train on N processes of this machine (torchrun --standalone)")
    add_max_memory_argument(parser)


def _add(group: argparse._ActionsContainer, key: str, help: str) -> str:
    """The flag of recipe key `key`, given or else absent from the parsed namespace; -> `key`."""
    group.add_argument("--" + key.replace("_", "-"), dest=key, default=argparse.SUPPRESS, help=help,
                       **recipe_flag(key))
    return key


def _shown_recipe(verb: Verb, argv: list[str]) -> Recipe:
    """The recipe named by --recipe (or --preset), else by the --config file, else (finetune) the one for --init's
    family, else the verb's default: the recipe whose flags the help lists, refused at once when unknown or
    (finetune) when it trains from scratch."""
    try:
        named = _RECIPE_FLAGS.parse_known_args(argv)[0]
    except argparse.ArgumentError:  # `--recipe` without a name: the verb's parser says so
        named = argparse.Namespace(preset=None, config=None, init=None)
    name = named.preset
    if name is None and named.config is not None:
        name = read_config_file(named.config).get("preset")
    if name is None and verb.fine_tuning and named.init is not None:
        name = _fine_tuning_preset(named.init, verb.default_recipe)
    return check_recipe(name or verb.default_recipe, verb.fine_tuning)


_RECIPE_FLAGS = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
_RECIPE_FLAGS.add_argument("--recipe", "--preset", dest="preset")
_RECIPE_FLAGS.add_argument("--config", type=Path)
_RECIPE_FLAGS.add_argument("--init")


def check_recipe(name: str, fine_tuning: bool) -> Recipe:
    """The recipe `name`; a UserError when there is none, or when `fine_tuning` (finetune) and it trains a model
    from scratch."""
    try:
        recipe = recipes.get(name)
    except ValueError as error:
        raise UserError(str(error)) from None
    if fine_tuning and recipe.model is not None:
        raise UserError(f"preset {name!r} trains a {recipe.family} model from scratch; finetune takes "
                        f"{', '.join(fine_tuning_recipes())} (or use plainformer train)")
    return recipe


# ----------------------------------------------------------------------------- the help

class _Formatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The description and the list of recipes as `verb_parser` and `_recipes_list` wrap them."""


def _width() -> int:
    return shutil.get_terminal_size().columns - 2  # argparse's


def _shown_note(verb: Verb, recipe: Recipe) -> str:
    return (f"Shown: recipe {recipe.name!r} ({recipe.family}), its flags and values; `plainformer {verb.name} "
            "--recipe NAME --help` shows another's.")


def _recipes_list() -> str:
    """The recipes, by family."""
    names: dict[str, list[str]] = {}
    for name, recipe in recipes.RECIPES.items():
        names.setdefault(recipe.family, []).append(name)
    width = max(map(len, names)) + 4
    return "recipes:\n" + "\n".join(textwrap.fill(", ".join(shown), _width(), initial_indent=f"  {family:{width - 2}}",
                                                  subsequent_indent=" " * width, break_on_hyphens=False)
                                    for family, shown in names.items())


def _in_family(text: Any, family: Family) -> str | None:
    return text.get(family.name) if isinstance(text, Mapping) else text


def _option_help(key: str, family: Family, recipe: Recipe) -> str:
    """An option's help: its text for `family`, its choices, and the recipe's value, else its default."""
    text = _in_family(OPTIONS[key]["help"], family)
    assert text is not None, f"the flag of {key} has no help for the {family.name} family"
    default = _in_family(OPTIONS[key].get("default"), family)
    value = f"recipe: {_shown(recipe.options[key])}" if key in recipe.options else \
        None if default is None else f"default: {_shown(default)}"
    return _described(text, OPTIONS[key].get("choices"), value)


def _field_help(config_cls: type[Config], name: str, value: str) -> str:
    """A config field's help: its `HELP`, its choices, and `value` (the recipe's, or the default)."""
    return _described(config_cls.HELP[name], field_choices(config_cls, name), value)


def _described(text: str, choices: Sequence[str] | None, value: str | None) -> str:
    """`text (a | b; value)`, as argparse reads a help (% doubled)."""
    notes = "; ".join(note for note in (" | ".join(choices or ()), value) if note)
    return (f"{text} ({notes})" if notes else text).replace("%", "%%")


def _recipe_value(recipe: Recipe, shaped: Sequence[Recipe], part: str, name: str) -> str:
    """"recipe: VALUE", the value of field `name` of the recipe's `part` ("model" or "train"); of each of its
    shapes (`shaped`: the recipe shaped as each of `recipe.shapes` says) where they differ ("recipe: 4 from
    600 GFLOP/s, else 3")."""
    values = [getattr(getattr(each, part), name) for each in shaped]
    if len(set(values)) > 1:
        faster = [f"{_shown(value)} {recipe.rates_taking(shape)}"
                  for value, shape in zip(values, recipe.shapes, strict=True)]
        return f"recipe: {', '.join(faster[:-1])}, else {_shown(values[-1])}"
    return f"recipe: {_shown(getattr(getattr(recipe, part), name))}"


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ", ".join(map(str, value))
    return str(value)


# ----------------------------------------------------------------------------- config files

def recipe_flags() -> dict[str, Mapping[str, Any]]:
    """Each key of a recipe file (`--config`, OUT/recipe.yaml) -> the argparse keywords of its flag, a boolean
    field's as its type."""
    flags: dict[str, Mapping[str, Any]] = {"preset": {}, "recipe": {}, "out": {"type": Path}}
    for key in recipe_keys() - set(flags):
        flag = recipe_flag(key)
        flags[key] = {"type": bool} if flag.get("action") is argparse.BooleanOptionalAction else flag
    return flags


def read_config_file(path: Path) -> dict[str, Any]:
    """The values of a YAML or JSON file of `train`'s flags, keys normalised to field names, the recipe under
    `preset` (a file names it `preset`, as OUT/recipe.yaml does, or `recipe`, as the flag)."""
    values = config_file.read_config_file(path, recipe_flags(), "plainformer train")
    if "recipe" in values:
        if "preset" in values:
            raise UserError(f"{path} gives the recipe twice (as preset and recipe)")
        values["preset"] = values.pop("recipe")
    return values


def read_run_recipe(run_dir: Path) -> dict[str, Any]:
    """The recipe a run directory was trained with ({} when it has none)."""
    path = run_dir / RECIPE_FILE
    return read_config_file(path) if path.is_file() else {}


# ----------------------------------------------------------------------------- resolving

def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe values given: the --config file's, then the command line's over them (a flag not given is
    absent from `args`; one given `none` is None)."""
    values = read_config_file(args.config) if args.config is not None else {}
    for key in recipe_keys():
        if hasattr(args, key):
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
    recipe = check_recipe(preset, fine_tuning)
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
