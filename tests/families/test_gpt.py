"""The GPT command line end to end on a tiny model: train -> eval -> sample, --config files and the
run's recipe.yaml, resume, Ctrl-C, errors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import plainformer as pf
from plainformer import recipes
from plainformer.cli import main
from plainformer.families import resolve as families_resolve

TINY_MODEL = ["--n-layers", "1", "--n-heads", "2", "--d-model", "32", "--d-ff", "64", "--block-size", "16"]
TINY_TRAINING = ["--batch-size", "4", "--eval-interval", "5", "--eval-batches", "2", "--warmup-steps", "2",
                 "--log-interval", "5"]


@pytest.fixture()
def text_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Five small 'works' separated by two blank lines; the last one becomes the validation split."""
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    works = [f"ACT {i}. To be, or not to be, that is the question {i}.\n" * 20 for i in range(5)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n\n".join(works), encoding="utf-8")
    return path


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def train(capsys, text_file: Path, out: Path, *extra: str) -> dict:
    code, stdout, _ = run_cli(capsys, "train", "--data", str(text_file), "--out", str(out), "--no-progress",
                              *TINY_MODEL, *TINY_TRAINING, *extra)
    assert code == 0
    return last_json(stdout)


def test_train_eval_sample_round_trip(capsys, text_file: Path, tmp_path: Path):
    metrics = train(capsys, text_file, tmp_path / "run", "--max-steps", "10")
    assert metrics["step"] == 10
    assert {"train_loss", "val_loss", "tokens_per_s", "elapsed_s"} <= set(metrics)
    for name in ("last", "best"):
        assert (tmp_path / "run" / name / "model.safetensors").is_file()
    assert (tmp_path / "run" / "loss.png").is_file()

    code, stdout, _ = run_cli(capsys, "eval", "--ckpt", str(tmp_path / "run"), "--data", str(text_file))
    evaluation = last_json(stdout)
    assert code == 0 and evaluation["tokens"] > 0
    assert evaluation["perplexity"] == pytest.approx(2.718281828 ** evaluation["val_loss"], rel=1e-6)

    samples = []
    for _ in range(2):
        code, stdout, stderr = run_cli(capsys, "sample", "--ckpt", str(tmp_path / "run"), "--prompt", "To be",
                                       "--max-new-tokens", "30", "--seed", "7")
        assert code == 0
        samples.append(stdout)
        assert last_json(stderr)["new_tokens"] == 30
    assert samples[0] == samples[1]
    assert samples[0].startswith("To be")


def test_sample_stdout_is_the_text_alone(capsys, text_file: Path, tmp_path: Path):
    train(capsys, text_file, tmp_path / "run", "--max-steps", "3")
    model = pf.GPT.from_checkpoint(tmp_path / "run" / "best")
    prompt = torch.tensor([model.tokenizer.encode("To be")])
    expected = model.generate(prompt, 25, temperature=0.8, generator=torch.Generator().manual_seed(5))
    code, stdout, stderr = run_cli(capsys, "sample", "--ckpt", str(tmp_path / "run"), "--prompt", "To be",
                                   "--max-new-tokens", "25", "--seed", "5")
    assert code == 0
    assert stdout == model.tokenizer.decode(expected[0].tolist()) + "\n"
    assert last_json(stderr)["new_tokens"] == 25
    code, with_json, _ = run_cli(capsys, "sample", "--ckpt", str(tmp_path / "run"), "--prompt", "To be",
                                 "--max-new-tokens", "25", "--seed", "5", "--json")
    text, metrics = with_json.rstrip("\n").rsplit("\n", 1)
    assert text + "\n" == stdout and json.loads(metrics)["new_tokens"] == 25


def test_sample_with_and_without_cache_writes_the_same_text(capsys, text_file: Path, tmp_path: Path):
    train(capsys, text_file, tmp_path / "run", "--max-steps", "3")
    texts = []
    for flags in ([], ["--no-cache"]):
        code, stdout, _ = run_cli(capsys, "sample", "--ckpt", str(tmp_path / "run"), "--max-new-tokens", "40",
                                  "--seed", "3", *flags)
        texts.append(stdout)
    assert texts[0] == texts[1]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "last" / "model.safetensors")


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[name], wb[name]) for name in wa)


def test_the_written_recipe_repeats_the_run(capsys, text_file: Path, tmp_path: Path):
    first = train(capsys, text_file, tmp_path / "first", "--max-steps", "4", "--lr", "3e-3")
    recipe = yaml.safe_load((tmp_path / "first" / "recipe.yaml").read_text())
    assert recipe["preset"] == "default" and recipe["lr"] == 3e-3 and recipe["n_layers"] == 1
    assert recipe["data"] == str(text_file) and "vocab_size" in recipe and "out" not in recipe
    code, stdout, _ = run_cli(capsys, "train", "--config", str(tmp_path / "first" / "recipe.yaml"),
                              "--out", str(tmp_path / "again"), "--no-progress")
    again = last_json(stdout)
    assert code == 0 and again["val_loss"] == first["val_loss"] and again["train_loss"] == first["train_loss"]
    assert _same_weights(tmp_path / "first", tmp_path / "again")


def test_the_default_trains_the_shape_the_probe_picks_and_repeats_it_on_resume_and_from_its_recipe(
        capsys, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    tiny = dict(zip([flag[2:].replace("-", "_") for flag in TINY_MODEL[::2]], map(int, TINY_MODEL[1::2]),
                    strict=True))
    default = recipes.get("default")
    shapes = (recipes.Shape("wide", 500.0, {}, {}), recipes.Shape("narrow", 0.0, dict(d_model=16, d_ff=32), {}))
    monkeypatch.setitem(recipes.RECIPES, "default", dataclasses.replace(
        default, model=default.model.replace(**tiny), shapes=shapes))
    monkeypatch.setattr(families_resolve, "matmul_rate", lambda dtype, seconds: 100e9)
    run = ["--data", str(text_file), "--no-progress", *TINY_TRAINING, "--no-fit-to-time"]
    code, _, stderr = run_cli(capsys, "train", "--out", str(tmp_path / "run"), "--max-steps", "2", *run)
    assert code == 0
    assert stderr.count("shape: narrow (float32 matmuls at 100 GFLOP/s on this machine") == 1
    assert pf.GPT.from_checkpoint(tmp_path / "run" / "last").config.d_model == 16
    assert yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())["d_model"] == 16

    monkeypatch.setattr(families_resolve, "matmul_rate", lambda dtype, seconds: 1e15)  # a faster machine now
    code, _, stderr = run_cli(capsys, "train", "--out", str(tmp_path / "run"), "--max-steps", "3", "--resume", *run)
    assert code == 0 and "shape:" not in stderr
    assert pf.GPT.from_checkpoint(tmp_path / "run" / "last").config.d_model == 16
    code, _, stderr = run_cli(capsys, "train", "--config", str(tmp_path / "run" / "recipe.yaml"),
                              "--out", str(tmp_path / "again"), "--max-steps", "1", "--no-progress")
    assert code == 0 and "shape:" not in stderr
    assert pf.GPT.from_checkpoint(tmp_path / "again" / "last").config.d_model == 16


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_sets_flags_and_the_command_line_wins(capsys, text_file: Path, tmp_path: Path, suffix):
    values = {"data": str(text_file), "n-layers": 1, "n_heads": 2, "d_model": 32, "d_ff": 64,
              "block_size": 16, "batch_size": 4, "eval_batches": 2, "warmup_steps": 2,
              "max_steps": 5, "lr": 2e-3, "seed": 11}
    config = tmp_path / f"run{suffix}"
    config.write_text(yaml.safe_dump(values) if suffix == ".yaml" else json.dumps(values))
    code, stdout, _ = run_cli(capsys, "train", "--config", str(config), "--out", str(tmp_path / "file"),
                              "--max-steps", "3", "--no-progress")
    assert code == 0 and last_json(stdout)["step"] == 3  # the flag beat the file's max_steps: 5
    written = yaml.safe_load((tmp_path / "file" / "recipe.yaml").read_text())
    assert written["max_steps"] == 3 and written["lr"] == 2e-3 and written["seed"] == 11
    assert written["n_layers"] == 1 and written["d_model"] == 32
    flags = train(capsys, text_file, tmp_path / "flags", "--max-steps", "3", "--lr", "2e-3", "--seed", "11",
                  "--eval-interval", "250", "--log-interval", "10")
    assert _same_weights(tmp_path / "file", tmp_path / "flags") and last_json(stdout)["val_loss"] == flags["val_loss"]


@pytest.mark.parametrize("content, message", [
    ("n_layer: 2\n", "unknown key 'n_layer'"),
    ("n_layers: two\n", "n_layers"),
    ("- 1\n- 2\n", "mapping"),
    ("tokenizer: wordpiece\n", "tokenizer"),
    ("task: copy\n", "--task applies to transformer"),
])
def test_bad_config_files_are_one_clear_error(capsys, tmp_path: Path, content: str, message: str):
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    code, stdout, stderr = run_cli(capsys, "train", "--config", str(config))
    assert code == 2 and stdout == ""
    assert stderr.startswith("plainformer: error:") and message in stderr
    assert len(stderr.strip().splitlines()) == 1


def test_resume_continues_to_the_same_weights_as_one_run(capsys, text_file: Path, tmp_path: Path):
    schedule = ["--decay-steps", "8"]  # the same learning-rate schedule whatever max_steps says
    whole = train(capsys, text_file, tmp_path / "whole", "--max-steps", "8", *schedule)
    train(capsys, text_file, tmp_path / "split", "--max-steps", "4", *schedule)
    resumed = train(capsys, text_file, tmp_path / "split", "--max-steps", "8", "--resume", *schedule)
    assert resumed["step"] == 8
    assert resumed["train_loss"] == whole["train_loss"]
    assert resumed["val_loss"] == whole["val_loss"]
    assert _same_weights(tmp_path / "whole", tmp_path / "split")


OLD_RUN = Path(__file__).parent.parent / "fixtures" / "gpt_run_before_variants"  # see tests/fixtures/README.md


def test_a_run_written_before_the_variant_fields_resumes_and_samples(capsys, tmp_path: Path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    monkeypatch.chdir(run)  # its recipe.yaml names its data as text.txt
    saved = json.loads((run / "last" / "config.json").read_text())["model"]
    assert "qk_norm" not in saved and "value_residual" not in saved
    code, stdout, stderr = run_cli(capsys, "train", "--out", str(run), "--resume", "--max-steps", "6", "--no-progress")
    assert code == 0, stderr
    assert last_json(stdout)["step"] == 6
    resumed = json.loads((run / "last" / "config.json").read_text())["model"]
    assert resumed == {**pf.GPTConfig().to_dict(), **saved}  # the new fields at the defaults, the rest kept
    code, stdout, stderr = run_cli(capsys, "sample", "--ckpt", str(run), "--max-new-tokens", "8", "--prompt", "To")
    assert code == 0, stderr
    assert stdout.startswith("To") and len(stdout) >= 8


def test_resume_refuses_changed_model_fields(capsys, text_file: Path, tmp_path: Path):
    train(capsys, text_file, tmp_path / "run", "--max-steps", "2")
    code, stdout, stderr = run_cli(capsys, "train", "--out", str(tmp_path / "run"), "--resume",
                                   "--d-model", "64", "--max-steps", "4")
    assert code == 2 and stdout == "" and "d_model" in stderr and "--resume" in stderr
    code, stdout, stderr = run_cli(capsys, "train", "--out", str(tmp_path / "run"), "--resume",
                                   "--preset", "nanogpt-cpu")
    assert code == 2 and stdout == "" and "preset" in stderr and "--resume" in stderr


def test_unknown_prompt_character_is_one_clear_error_line(capsys, text_file: Path, tmp_path: Path):
    train(capsys, text_file, tmp_path / "run", "--max-steps", "1")
    code, stdout, stderr = run_cli(capsys, "sample", "--ckpt", str(tmp_path / "run"), "--prompt", "Zéphyr")
    assert code == 2 and stdout == ""
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert "'Z'" in stderr or "'é'" in stderr


@pytest.mark.parametrize("argv, expected", [
    (["sample", "--ckpt", "does-not-exist"], "does-not-exist"),
    (["eval", "--ckpt", "does-not-exist"], "does-not-exist"),
    (["train", "--data", "missing.txt"], "missing.txt"),
    (["train", "--max-steps", "0"], "max_steps"),
    (["train", "--d-model", "30", "--n-heads", "4"], "d_model"),
    (["train", "--preset", "gpt3"], "unknown preset 'gpt3'; choose one of default, moe, nanogpt-cpu"),
    (["train", "--seq-len", "12"], "--seq-len applies to bert-mlm, bert-cls"),
    (["train", "--max-len", "12"], "not a field of GPTConfig"),
    (["train", "--vocab-size", "100"], "char tokenizer"),
    (["train", "--config", "missing.yaml"], "missing.yaml"),
    (["finetune", "--preset", "default"], "bert-finetune"),
])
def test_user_errors_exit_2_with_one_line(capsys, text_file: Path, argv: list[str], expected: str):
    code, stdout, stderr = run_cli(capsys, *argv)
    assert code == 2 and stdout == ""
    assert stderr.startswith("plainformer: error:") and expected in stderr
    assert len(stderr.strip().splitlines()) == 1


def test_help_and_version():
    for flag in ("--help", "--version"):
        result = subprocess.run([sys.executable, "-m", "plainformer", flag], capture_output=True, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0 and "plainformer" in result.stdout


def test_ctrl_c_saves_a_checkpoint_and_exits_130(text_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "plainformer", "train", "--data", str(text_file), "--out", str(out),
               "--no-progress", *TINY_MODEL, *TINY_TRAINING, "--max-steps", "100000", "--save-interval", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr and "--resume" in stderr and "Traceback" not in stderr
    metrics = last_json(stdout)
    assert metrics["interrupted"] is True and metrics["step"] > 0
    assert (out / "last" / "model.safetensors").is_file()
