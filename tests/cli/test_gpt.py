"""The GPT command line end to end on a tiny model: train -> eval -> sample, resume, Ctrl-C, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from plainformer.cli import main

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
        code, stdout, _ = run_cli(capsys, "sample", "--ckpt", str(tmp_path / "run"), "--prompt", "To be",
                                  "--max-new-tokens", "30", "--seed", "7")
        assert code == 0
        samples.append(stdout.rsplit("\n", 2)[0])
        assert last_json(stdout)["new_tokens"] == 30
    assert samples[0] == samples[1]
    assert samples[0].startswith("To be")


def test_sample_with_and_without_cache_writes_the_same_text(capsys, text_file: Path, tmp_path: Path):
    train(capsys, text_file, tmp_path / "run", "--max-steps", "3")
    texts = []
    for flags in ([], ["--no-cache"]):
        code, stdout, _ = run_cli(capsys, "sample", "--ckpt", str(tmp_path / "run"), "--max-new-tokens", "40",
                                  "--seed", "3", *flags)
        texts.append(stdout.rsplit("\n", 2)[0])
    assert texts[0] == texts[1]


def test_resume_continues_to_the_same_weights_as_one_run(capsys, text_file: Path, tmp_path: Path):
    schedule = ["--decay-steps", "8"]  # the same learning-rate schedule whatever max_steps says
    whole = train(capsys, text_file, tmp_path / "whole", "--max-steps", "8", *schedule)
    train(capsys, text_file, tmp_path / "split", "--max-steps", "4", *schedule)
    resumed = train(capsys, text_file, tmp_path / "split", "--max-steps", "8", "--resume", *schedule)
    assert resumed["step"] == 8
    assert resumed["train_loss"] == whole["train_loss"]
    assert resumed["val_loss"] == whole["val_loss"]
    weights = [load_file(tmp_path / run / "last" / "model.safetensors") for run in ("whole", "split")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


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
])
def test_user_errors_exit_2_with_one_line(capsys, text_file: Path, argv: list[str], expected: str):
    code, stdout, stderr = run_cli(capsys, *argv)
    assert code == 2 and stdout == ""
    assert stderr.startswith("plainformer: error:") and expected in stderr
    assert len(stderr.strip().splitlines()) == 1


def test_help_and_version():
    for flag in ("--help", "--version"):
        result = subprocess.run([sys.executable, "-m", "plainformer", flag], capture_output=True, text=True)
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
