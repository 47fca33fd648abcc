"""How `plainformer train` resolves a recipe, without training: the preset, the --config file and the
flags, in that order of priority; every family's recipe survives the round trip through recipe.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from plainformer import recipes
from plainformer.cli import UserError, build_parser
from plainformer.cli.train import read_config_file, resolve


def _resolve(*argv: str, default: str = "default"):
    return resolve(build_parser().parse_args(["train", *argv]), default)


@pytest.mark.parametrize("name", recipes.names())
def test_the_preset_selects_model_training_and_options(name):
    run = _resolve("--preset", name)
    recipe = recipes.get(name)
    assert (run.family, run.model, run.train) == (recipe.family, recipe.model, recipe.train)
    assert run.options == dict(recipe.options) and run.out == Path("runs") / name


@pytest.mark.parametrize("name", recipes.names())
def test_the_written_recipe_reads_back_to_the_same_run(name, tmp_path):
    extra = ["--dropout", "0.1"] if name != "bert-finetune" else ["--attention-dropout", "0.2"]
    run = _resolve("--preset", name, "--lr", "0.0042", "--threads", "2", *extra)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(run.recipe_values()))
    again = _resolve("--config", str(path))
    assert (again.preset, again.family, again.model, again.train) == (run.preset, run.family, run.model, run.train)
    assert again.options == run.options
    if run.model is None:  # fine-tuning: only the fields given travel, the shape is --init's
        assert again.model_overrides == run.model_overrides == {"attention_dropout": 0.2}


def test_flags_override_the_recipe_field_by_field():
    run = _resolve("--preset", "gpt2", "--n-layers", "2", "--max-steps", "7")
    gpt2 = recipes.get("gpt2")
    assert run.model == gpt2.model.replace(n_layers=2)
    assert run.train == gpt2.train.replace(max_steps=7)


def test_the_inverse_sqrt_schedule_follows_the_models_d_model_unless_given():
    assert _resolve("--preset", "seq2seq-numbers-en-fr", "--d-model", "256").train.schedule_d_model == 256
    given = _resolve("--preset", "seq2seq-numbers-en-fr", "--d-model", "256", "--schedule-d-model", "64")
    assert given.train.schedule_d_model == 64


def test_config_file_keys_take_dashes_or_underscores_and_yaml_strings_as_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("n-layers: 3\nlr: 1e-3\ndata: some/file.txt\nbias: true\n")
    assert read_config_file(path) == {"n_layers": 3, "lr": 1e-3, "data": "some/file.txt", "bias": True}


def test_the_config_file_names_the_preset_and_the_command_line_wins(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"preset": "nanogpt-cpu", "max_steps": 5, "lr": 0.01}')
    run = _resolve("--config", str(path), "--max-steps", "9")
    assert run.preset == "nanogpt-cpu" and run.train.max_steps == 9 and run.train.lr == 0.01
    assert _resolve("--config", str(path), "--preset", "default").preset == "default"


@pytest.mark.parametrize("line, message", [
    ("plays: Macbeth", r"plays in .*c\.yaml must be a list of str, got 'Macbeth'"),
    ("data: 5", r"data in .*c\.yaml must be a str, got 5"),
    ("preset: [gpt2]", r"preset in .*c\.yaml must be a str, got \['gpt2'\]"),
    ("out: {a: 1}", r"out in .*c\.yaml must be a path \(a str\), got \{'a': 1\}"),
    ("n_layers: 2.5", r"n_layers in .*c\.yaml must be an int, got float 2\.5"),
    ("bias: 3", r"bias in .*c\.yaml must be a bool, got int 3"),
    ("lr: .nan", r"lr in .*c\.yaml must be a finite number, got nan"),
    ("threads: 0", r"threads in .*c\.yaml: expected a positive integer, got '0'"),
    ("seq_len: [3]", r"seq_len in .*c\.yaml: expected a positive integer, got '\[3\]'"),
])
def test_a_config_file_value_of_the_wrong_type_names_the_file_and_the_key(tmp_path, line, message):
    path = tmp_path / "c.yaml"
    path.write_text(line + "\n")
    with pytest.raises(UserError, match=message):
        read_config_file(path)


def test_a_config_file_that_is_not_utf8_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"preset: default\nlr: 0.001 \xe9\n")
    with pytest.raises(UserError, match=r"c\.yaml is not UTF-8 text \(byte offset 26\)"):
        read_config_file(path)
