"""`plainformer sample`: one streamed sample, a batch of them (--num-samples, --prompt-file) in which each
equals its own run alone, stop strings that end a sample unprinted, and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import plainformer.inference as inference
from plainformer.cli import main
from plainformer.inference.prepack import prepack
from tests.reference.runs import trained_run

TINY = ["--n-layers", "1", "--n-heads", "2", "--d-model", "32", "--d-ff", "64", "--block-size", "16",
        "--batch-size", "4", "--eval-interval", "4", "--eval-batches", "2", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    text = "\n\n\n".join(f"To be, or not to be, that is the question {i}.\n" * 20 for i in range(5))
    return trained_run(tmp_path_factory.mktemp("sample"), text, "--max-steps", "8", *TINY)


def sample(capsys, run: Path, *argv: str) -> str:
    code = main(["sample", "--ckpt", str(run), "--max-new-tokens", "24", *argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_num_samples_prints_each_sample_as_its_seed_alone_would(capsys, run):
    batch = sample(capsys, run, "--prompt", "To be", "--num-samples", "3", "--seed", "11")
    alone = [sample(capsys, run, "--prompt", "To be", "--seed", str(seed)) for seed in (11, 12, 13)]
    assert batch == "---\n".join(alone)


def test_the_largest_seed_with_two_samples_wraps_to_seed_zero(capsys, run):
    batch = sample(capsys, run, "--prompt", "To be", "--num-samples", "2", "--seed", str(2**64 - 1))
    alone = [sample(capsys, run, "--prompt", "To be", "--seed", str(seed)) for seed in (2**64 - 1, 0)]
    assert batch == "---\n".join(alone)


@pytest.mark.parametrize("temperature", ["1e-300", "3e-38"])
def test_a_temperature_too_small_to_divide_by_samples_greedily(capsys, run, temperature):
    for argv in ([], ["--num-samples", "2"]):
        tiny = sample(capsys, run, "--prompt", "To be", "--temperature", temperature, *argv)
        assert tiny == sample(capsys, run, "--prompt", "To be", "--temperature", "0", *argv)


def test_a_prompt_file_samples_its_lines_in_order_in_one_batch(capsys, run, tmp_path):
    prompts = ["To be", "that is the question", "T"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n\n")  # blank lines are no prompts
    batch = sample(capsys, run, "--prompt-file", str(path), "--separator", "=====", "--seed", "3")
    alone = [sample(capsys, run, "--prompt", prompt, "--seed", str(3 + i)) for i, prompt in enumerate(prompts)]
    assert batch == "=====\n".join(alone)


@pytest.mark.parametrize("batched", [False, True])
def test_a_stop_string_ends_the_sample_and_is_not_printed(capsys, run, batched):
    greedy = ["--prompt", "To", "--temperature", "0"]
    text = sample(capsys, run, *greedy).removesuffix("\n")[len("To"):]
    stop = text[5:7]
    expected = "To" + text[:text.index(stop)] + "\n"
    batch = ["--num-samples", "2"] if batched else []
    got = sample(capsys, run, *greedy, "--stop", stop, "--stop", "no such text", *batch)
    assert got == (expected + "---\n" + expected if batched else expected)


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "To", "--prompt-file", "p.txt"], "give --prompt or --prompt-file, not both"),
    (["--prompt-file", "no/such/file.txt"], "--prompt-file no/such/file.txt is not a file"),
    (["--stop", ""], "--stop: expected a non-empty string"),
    (["--num-samples", "0"], "--num-samples: expected a positive integer"),
])
def test_sample_errors_are_one_line(capsys, run, argv, message):
    code = main(["sample", "--ckpt", str(run), *argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and message in captured.err and len(captured.err.splitlines()) == 1


def test_a_max_memory_of_400_digits_is_refused_as_more_than_the_machine_has(capsys, run):
    code = main(["sample", "--ckpt", str(run), "--prompt", "To", "--max-memory=" + "9" * 400])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and "is more than this machine has: " in err[0], err


def test_a_prompt_file_without_prompts_is_one_line(capsys, run, tmp_path):
    (tmp_path / "empty.txt").write_text("\n  \n")
    code = main(["sample", "--ckpt", str(run), "--prompt-file", str(tmp_path / "empty.txt")])
    assert code == 2 and "holds no prompt" in capsys.readouterr().err


def test_sample_and_eval_run_int8_weights_close_to_float32(capsys, run):
    text = sample(capsys, run, "--prompt", "To be", "--quantize", "int8")
    assert text.startswith("To be") and len(text) > len("To be\n")
    losses = []
    for extra in ([], ["--quantize", "int8"]):
        assert main(["eval", "--ckpt", str(run), *extra]) == 0
        losses.append(json.loads(capsys.readouterr().out)["val_loss"])
    assert abs(losses[1] - losses[0]) <= 0.02 * losses[0]


def test_int8_with_bfloat16_is_one_line(capsys, run):
    code = main(["sample", "--ckpt", str(run), "--quantize", "int8", "--dtype", "bfloat16"])
    assert code == 2 and "--quantize int8 quantizes the float32 weights" in capsys.readouterr().err


def test_sample_decodes_on_prepacked_weights_on_the_cpu_unless_int8(capsys, run, monkeypatch):
    heads: list[str] = []

    def recording_prepack(model):
        heads.append(type(prepack(model).lm_head).__name__)
        return model

    monkeypatch.setattr(inference, "prepack", recording_prepack)  # what for_decoding calls
    assert sample(capsys, run, "--prompt", "To be").startswith("To be")
    assert heads == ["PackedLinear"]
    sample(capsys, run, "--prompt", "To be", "--quantize", "int8")
    assert heads == ["PackedLinear"]


def test_a_command_keeps_freed_memory_before_it_runs(run, monkeypatch, capsys):
    import plainformer.cli as cli

    kept = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: kept.append(True))
    assert main(["sample", "--ckpt", str(run), "--max-new-tokens", "2"]) == 0
    assert kept == [True]
