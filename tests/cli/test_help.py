"""Every verb's --help (`plainformer.cli.build_parser`, and the parser `cli/train.py` builds for a recipe): two
screens at most on a terminal 100 columns wide, every flag with a help text, and `train` / `finetune` listing a
recipe's flags only, each of which its resolution takes, and every flag it takes."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from plainformer import families, recipes
from plainformer.cli import COMMAND_MODULES, UserError, build_parser, main
from plainformer.cli.train import recipe_keys, resolve
from plainformer.families import resolve as families_resolve
from plainformer.families.resolve import model_configs
from plainformer.training.config import TrainConfig

COLUMNS = 100
MAX_LINES = 120  # two screens
VERBS = ("train", "finetune", *(name for name in COMMAND_MODULES if name != "train"))
# Each verb of train's with each recipe it runs.
RECIPE_HELPS = [("train", name) for name in recipes.names()] + [
    ("finetune", name) for name in recipes.names() if recipes.get(name).model is None]
# A value each option takes, where the recipe gives none (the resolution reads no file).
OPTION_VALUES = {"data": "x.txt", "val_data": "y.txt", "source_lang": "de", "target_lang": "en", "batch_tokens": 100,
                 "text_field": "text", "text_pair_field": "pair", "label_field": "label", "tokenizer": "char",
                 "vocab_size": 100, "seq_len": 16, "task": "copy", "init": "some/model", "lora_r": 4,
                 "lora_alpha": 8.0, "lora_dropout": 0.1, "lora_targets": "W_q", "plays": ["Macbeth", "Hamlet"],
                 "threads": 1}


@pytest.fixture(autouse=True)
def terminal(monkeypatch):
    """A terminal 100 columns wide, as argparse measures it; and no probe of the matmul rate."""
    monkeypatch.setenv("COLUMNS", str(COLUMNS))
    monkeypatch.setattr(families_resolve, "matmul_rate", lambda dtype, seconds: 1e15)


def help_text(capsys, *argv: str) -> str:
    """What `plainformer ARGV --help` prints (and exits 0 after)."""
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--help"])
    captured = capsys.readouterr()
    assert exit.value.code == 0 and captured.err == ""
    return captured.out


def flat(text: str) -> str:
    """`text` on one line, as argparse wraps its descriptions."""
    return " ".join(text.split())


def verb_parser(*argv: str) -> argparse.ArgumentParser:
    """The parser that reads `plainformer ARGV`: the verb's, or the one train's verbs build for the recipe."""
    (subcommands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = subcommands.choices[argv[0]]
    return parser.build(list(argv[1:])) if parser.build is not None else parser


def listed(text: str) -> list[str]:
    """The keys of the flags a help lists, --[no-]bias as bias, --recipe, --preset as recipe."""
    flags = re.findall(r"^  (?:-\w, )?--(?:\[no-\])?([\w-]+)", text, re.M)
    return [flag.replace("-", "_") for flag in flags]


@pytest.mark.parametrize("argv", [(verb,) for verb in VERBS] + [(verb, "--recipe", name)
                                                                  for verb, name in RECIPE_HELPS])
def test_every_help_fits_two_screens_and_every_flag_says_what_it_does(argv, capsys):
    text = help_text(capsys, *argv)
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"{' '.join(argv)} --help: {len(lines)} lines"
    assert max(map(len, lines)) <= COLUMNS  # so that each line is one on the terminal
    shown = [action for action in verb_parser(*argv)._actions if action.help != argparse.SUPPRESS]
    assert shown and all(action.help and action.help.strip() for action in shown), \
        [action.dest for action in shown if not (action.help and action.help.strip())]


@pytest.mark.parametrize("config", [*model_configs(), TrainConfig])
def test_every_config_says_in_one_line_what_each_of_its_fields_means(config):
    assert list(config.HELP) == [field.name for field in dataclasses.fields(config)]
    assert all(text and "\n" not in text for text in config.HELP.values())


def _value(recipe: recipes.Recipe, key: str):
    """The recipe's value of `key` (an option, a model or TrainConfig field), else one the key takes."""
    if key in recipe.options:
        return recipe.options[key]
    if key in OPTION_VALUES:
        return OPTION_VALUES[key]
    if key in {field.name for field in dataclasses.fields(TrainConfig)}:
        return getattr(recipe.train, key)
    config = recipe.model or families.get(recipe.family).config()
    return getattr(config, key, next(getattr(c(), key) for c in model_configs() if hasattr(c(), key)))


def _flags(values: dict) -> list[str]:
    """Command-line flags setting `values`, as a user types them."""
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            argv += [flag, *(map(str, value) if isinstance(value, list) else ["none" if value is None else str(value)])]
    return argv


@pytest.mark.parametrize("verb, name", RECIPE_HELPS)
def test_a_recipes_help_lists_the_flags_it_takes_and_no_other(verb, name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = recipes.get(name)
    keys = listed(help_text(capsys, verb, "--recipe", name))
    assert len(keys) == len(set(keys)) and {"help", "recipe", "config", "out", "resume"} <= set(keys)
    taken = [key for key in keys if key in recipe_keys() and key not in ("recipe", "out")]
    fine_tuning = verb == "finetune"
    default = "bert-finetune" if fine_tuning else "default"
    # Every flag listed, given at once at the recipe's value: the run resolves to the recipe's own.
    args = build_parser().parse_args([verb, "--recipe", name, *_flags({key: _value(recipe, key) for key in taken})])
    run = resolve(args, default, fine_tuning)
    assert (run.preset, run.family_name, run.train_config) == (name, recipe.family, recipe.train)
    if recipe.model is not None:
        assert run.model == recipe.model.replace(**{s: getattr(run.model, s) for s in recipe.shape_fields()})
    # Every other key of a recipe, given alone (with the --init a fine-tuning recipe needs): refused by name.
    needed = {"init": "some/model"} if recipe.model is None and "init" not in recipe.options else {}
    for key in sorted(recipe_keys() - set(keys) - {"preset", "out"}):
        args = build_parser().parse_args([verb, "--recipe", name, *_flags({**needed, key: _value(recipe, key)})])
        with pytest.raises(UserError, match="applies to|is not a field of|does not apply|keeps the shape"):
            resolve(args, default, fine_tuning)


@pytest.mark.parametrize("argv, absent", [
    (("train",), ["n_encoder_layers", "label_field", "task", "seq_len", "init", "lora_r", "attention_dropout"]),
    (("train", "--recipe", "default"), ["n_encoder_layers", "label_field", "source_lang", "plays"]),
    (("train", "--preset", "seq2seq-copy"), ["block_size", "tokenizer", "text_field", "rope_base", "init"]),
    (("train", "--recipe", "bert-pretrain"), ["val_data", "n_kv_heads", "tokenizer", "task", "lora_r"]),
    (("finetune",), ["n_layers", "d_model", "tokenizer", "vocab_size", "block_size", "task"]),
    (("finetune", "--recipe", "gpt-finetune"), ["n_layers", "tokenizer", "vocab_size", "plays", "attention_dropout"]),
])
def test_a_help_lists_no_flag_of_another_family_nor_a_shape_flag_for_a_fine_tuning(argv, absent, capsys):
    assert not set(absent) & set(listed(help_text(capsys, *argv)))


def test_the_help_shows_the_recipes_values_its_shapes_and_the_defaults(capsys):
    text = help_text(capsys, "train")
    assert "Shown: recipe 'default' (gpt)" in flat(text) and "plainformer train --recipe NAME --help" in flat(text)
    assert re.search(r"--n-layers N +blocks \(recipe: 4 from 600 GFLOP/s, else 3\)", text)
    assert re.search(r"--max-time X +.*\(recipe: 200\.0\)", text)
    assert re.search(r"--norm NAME +.*\(layernorm \| rmsnorm; recipe: rmsnorm\)", text)
    assert re.search(r"--\[no-\]qk-norm +.*\(recipe: off\)", text)
    assert re.search(r"--vocab-size N +.*\(default: 2048\)", text)
    text = help_text(capsys, "finetune", "--recipe", "gpt-finetune")
    assert re.search(r"--dropout X +.*\(default: --init's\)", text)
    assert re.search(r"--lr X +.*\(recipe: 0\.0003\)", text)
    text = help_text(capsys, "train", "--recipe", "multi30k-de-en")
    assert re.search(r"--source-lang LANG +.*\(recipe: de\)", text)


def test_the_help_of_the_recipe_a_config_file_names(capsys, tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("recipe: seq2seq-copy\nn_layers: 2\n")
    assert "Shown: recipe 'seq2seq-copy' (transformer)" in flat(help_text(capsys, "train", "--config", str(config)))
    assert "Shown: recipe 'default' (gpt)" in flat(help_text(capsys, "train", "--config", str(config), "--recipe",
                                                             "default"))


def test_finetunes_help_shows_the_recipe_for_inits_family(capsys, run):
    assert "Shown: recipe 'gpt-finetune' (gpt)" in flat(help_text(capsys, "finetune", "--init", str(run)))
    assert "Shown: recipe 'bert-finetune' (bert-cls)" in flat(help_text(capsys, "finetune", "--init", "minilm"))


@pytest.mark.parametrize("argv, message", [
    (["train", "--recipe", "gpt3", "--help"], "unknown preset 'gpt3'; choose one of default, moe, nanogpt-cpu"),
    (["finetune", "--recipe", "default", "--help"], "finetune takes gpt-finetune, bert-finetune, sst2"),
    (["train", "--recipe"], "argument --recipe/--preset: expected one argument"),
])
def test_a_recipe_that_cannot_be_shown_is_one_error_line(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and message in captured.err


def test_the_top_level_help_names_every_verb(capsys):
    text = help_text(capsys)
    assert all(re.search(rf"^    {verb}\b", text, re.M) for verb in VERBS)
