"""The encoder-decoder through the real command line, end to end on the copy task: `train --preset
seq2seq-copy` with the recipe's defaults copies the whole test split exactly; `eval` and `translate`
read the run back; user mistakes exit with status 2 and one line on stderr."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys

import pytest

from plainformer.cli import main


def _run(capsys, *argv: str) -> tuple[int, list[str], str]:
    """(exit status, stdout lines, stderr) of `plainformer ARGV`."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


# The copy recipe's learned exact-match rate on its 500 test strings: 1.0 with the vector kernels (AVX2,
# AVX-512, AMX), 0.998 with the scalar ones (ATEN_CPU_CAPABILITY=default), whose fp32 sums, taken in another
# order through 900 steps, train other weights: a learned result, so a bound rather than an equality.
COPIED = 0.99


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    """`plainformer train --preset seq2seq-copy --out DIR`: (DIR, status, stdout lines)."""
    out = tmp_path_factory.mktemp("copy")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        status = main(["train", "--preset", "seq2seq-copy", "--out", str(out), "--no-progress"])
    return out, status, stdout.getvalue().splitlines()


def test_train_copy_recipe_copies_the_test_split_exactly(copy_run):
    out, status, lines = copy_run
    assert status == 0 and len(lines) == 1
    metrics = json.loads(lines[0])
    assert metrics["test_exact_match"] >= COPIED and metrics["test_sentences"] == 500
    assert metrics["test_bleu"] >= 100 * COPIED  # over characters: a symbol string is one word
    assert metrics["task"] == "copy" and metrics["step"] == 900
    assert (out / "best" / "model.safetensors").is_file() and (out / "recipe.yaml").is_file()


@pytest.mark.parametrize("command, beam", [(["eval"], "1"), (["eval"], "4")])
def test_eval_scores_the_runs_task_on_its_test_split(copy_run, capsys, command, beam):
    status, lines, err = _run(capsys, *command, "--ckpt", str(copy_run[0]), "--beam", beam)
    assert status == 0 and len(lines) == 1
    metrics = json.loads(lines[0])
    assert metrics["exact_match"] >= COPIED and metrics["beam"] == int(beam) and metrics["task"] == "copy"
    assert metrics["split"] == "test" and metrics["sentences"] == 500
    assert f"exact match {100 * metrics['exact_match']:.2f}%" in err


def test_translate_prints_only_the_translations(copy_run, capsys, monkeypatch):
    out = copy_run[0]
    status, lines, err = _run(capsys, "translate", "--ckpt", str(out / "best"), "--beam", "4", "jihgfedcba")
    assert status == 0 and lines == ["jihgfedcba"]
    assert json.loads(err.strip().splitlines()[-1])["sentences"] == 1
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"abc\n\ncab\r\n")))
    status, lines, _ = _run(capsys, "translate", "--ckpt", str(out), "--json")
    assert status == 0 and lines[:3] == ["abc", "", "cab"] and json.loads(lines[3])["sentences"] == 3
    assert len(lines) == 4


def test_translate_refuses_input_that_is_not_utf8_in_one_line(copy_run, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"abc\ncaf\xe9\n")))
    status, lines, err = _run(capsys, "translate", "--ckpt", str(copy_run[0]))
    assert status == 2 and lines == []
    assert err.strip() == "plainformer: error: standard input is not UTF-8 text (byte offset 7)"


@pytest.mark.parametrize("argv", [["train", "--preset", "seq2seq-copy"]])
def test_resume_continues_to_the_new_max_steps(copy_run, capsys, tmp_path, argv):
    run = tmp_path / "run"
    shutil.copytree(copy_run[0], run)
    status, lines, _ = _run(capsys, *argv, "--out", str(run), "--resume", "--max-steps", "910",
                            "--no-progress")
    assert status == 0
    metrics = json.loads(lines[0])
    assert metrics["step"] == 910 and metrics["task"] == "copy"


def test_resume_refuses_a_changed_model_or_task(copy_run, capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(copy_run[0], run)
    for extra, named in ((["--d-model", "128"], "d_model"), (["--task", "reverse"], "task")):
        status, lines, err = _run(capsys, "train", "--preset", "seq2seq-copy", "--out", str(run),
                                  "--resume", *extra)
        assert status == 2 and not lines and named in err and "--resume" in err


@pytest.mark.parametrize("argv, message", [
    (["eval", "--ckpt", "/nonexistent/run"], "no checkpoint"),
    (["translate", "--ckpt", "/nonexistent/run", "abc"], "no checkpoint"),
    (["train", "--preset", "seq2seq-copy", "--threads", "0"], "--threads"),
    (["train", "--preset", "seq2seq-copy", "--d-model", "30"], "d_model"),
    (["train", "--preset", "seq2seq-copy", "--block-size", "8"], "TransformerConfig"),
    (["train", "--preset", "seq2seq-copy", "--tokenizer", "bpe"], "--tokenizer applies to gpt"),
])
def test_user_errors_exit_2_with_one_line(capsys, argv, message):
    status, lines, err = _run(capsys, *argv)
    assert status == 2 and not lines
    assert message in err and len(err.strip().splitlines()) == 1


def test_eval_flags_of_another_family_are_refused(copy_run, capsys):
    status, lines, err = _run(capsys, "eval", "--ckpt", str(copy_run[0]), "--dtype", "bfloat16")
    assert status == 2 and not lines and "--dtype applies to gpt" in err


def test_eval_of_a_checkpoint_without_its_recipe_asks_for_task(copy_run, capsys, tmp_path):
    shutil.copytree(copy_run[0] / "best", tmp_path / "lonely" / "ckpt")
    status, _, err = _run(capsys, "eval", "--ckpt", str(tmp_path / "lonely" / "ckpt"))
    assert status == 2 and "--task" in err
    status, lines, _ = _run(capsys, "eval", "--ckpt", str(tmp_path / "lonely" / "ckpt"), "--task", "copy")
    assert status == 0 and json.loads(lines[0])["exact_match"] >= COPIED


@pytest.mark.parametrize("group", ["seq2seq", "bert"])
def test_the_removed_command_groups_are_one_line_errors_that_list_the_verbs(capsys, group):
    status, lines, err = _run(capsys, group, "train")
    assert status == 2 and not lines and len(err.strip().splitlines()) == 1
    assert f"invalid choice: '{group}'" in err and "'train'" in err and "'translate'" in err
