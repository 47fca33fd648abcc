"""`plainformer seq2seq train | eval` and `plainformer translate`, end to end on the copy task:
trained with its defaults it copies the whole test split exactly within 60 s of CPU time (its wall
time on 2 idle cores; on a machine shared with other work the wall clock says more about the others);
each command ends with one JSON line on stdout; user mistakes exit with status 2 and one line on stderr."""

from __future__ import annotations

import argparse
import io
import json
import sys
import time

import pytest

import plainformer.cli
from plainformer.cli import seq2seq


def _parser_with_seq2seq() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plainformer")
    seq2seq.register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser


@pytest.fixture(autouse=True)
def seq2seq_parser(monkeypatch):
    """plainformer's main with the seq2seq commands registered on its parser."""
    monkeypatch.setattr(plainformer.cli, "build_parser", _parser_with_seq2seq)


def _run(capsys, *argv: str) -> tuple[int, list[str], str]:
    """(exit status, stdout lines, stderr) of `plainformer ARGV`."""
    status = plainformer.cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    """`plainformer seq2seq train --task copy --out DIR`: (DIR, status, stdout lines, CPU s, wall s)."""
    out = tmp_path_factory.mktemp("copy")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plainformer.cli, "build_parser", _parser_with_seq2seq)
        stdout = io.StringIO()
        patch.setattr(sys, "stdout", stdout)
        cpu, wall = time.process_time(), time.perf_counter()
        status = plainformer.cli.main(["seq2seq", "train", "--task", "copy", "--out", str(out)])
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return out, status, stdout.getvalue().splitlines(), cpu, wall


def test_train_copy_with_defaults_copies_the_test_split_exactly_in_under_60_s(copy_run):
    out, status, lines, cpu, wall = copy_run
    assert status == 0 and len(lines) == 1
    metrics = json.loads(lines[0])
    assert metrics["test_exact_match"] == 1.0 and metrics["test_sentences"] == 500
    assert metrics["task"] == "copy" and metrics["step"] == 900
    assert cpu < 60, f"took {cpu:.1f} s of CPU time ({wall:.1f} s wall)"
    assert (out / "best" / "model.safetensors").is_file() and (out / "task.json").is_file()


@pytest.mark.parametrize("beam", ["1", "4"])
def test_eval_scores_the_runs_task_on_its_test_split(copy_run, capsys, beam):
    out = copy_run[0]
    status, lines, err = _run(capsys, "seq2seq", "eval", "--ckpt", str(out), "--beam", beam)
    assert status == 0 and len(lines) == 1
    metrics = json.loads(lines[0])
    assert metrics["exact_match"] == 1.0 and metrics["beam"] == int(beam) and metrics["task"] == "copy"
    assert "exact match 100.00%" in err


def test_translate_text_and_stdin_lines(copy_run, capsys, monkeypatch):
    out = copy_run[0]
    status, lines, _ = _run(capsys, "translate", "--ckpt", str(out / "best"), "--beam", "4", "jihgfedcba")
    assert status == 0 and lines[0] == "jihgfedcba" and json.loads(lines[1])["sentences"] == 1
    monkeypatch.setattr(sys, "stdin", io.StringIO("abc\n\ncab\n"))
    status, lines, _ = _run(capsys, "translate", "--ckpt", str(out))
    assert status == 0 and lines[:3] == ["abc", "", "cab"] and json.loads(lines[3])["sentences"] == 3


def test_resume_continues_to_the_new_max_steps(copy_run, capsys, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(copy_run[0], run)
    status, lines, _ = _run(capsys, "seq2seq", "train", "--task", "copy", "--out", str(run), "--resume",
                            "--max-steps", "910", "--no-progress")
    assert status == 0 and json.loads(lines[0])["step"] == 910


@pytest.mark.parametrize("argv, message", [
    (["seq2seq", "eval", "--ckpt", "/nonexistent/run"], "no checkpoint"),
    (["translate", "--ckpt", "/nonexistent/run", "abc"], "no checkpoint"),
    (["seq2seq", "train", "--task", "copy", "--threads", "0"], "--threads"),
    (["seq2seq", "train", "--task", "copy", "--d-model", "30"], "d_model"),
])
def test_user_errors_exit_2_with_one_line(capsys, argv, message):
    status, lines, err = _run(capsys, *argv)
    assert status == 2 and not lines
    assert message in err and len(err.strip().splitlines()) == 1


def test_eval_of_a_checkpoint_without_task_file_asks_for_task(copy_run, capsys, tmp_path):
    import shutil

    shutil.copytree(copy_run[0] / "best", tmp_path / "lonely" / "ckpt")
    status, _, err = _run(capsys, "seq2seq", "eval", "--ckpt", str(tmp_path / "lonely" / "ckpt"))
    assert status == 2 and "--task" in err
    status, lines, _ = _run(capsys, "seq2seq", "eval", "--ckpt", str(tmp_path / "lonely" / "ckpt"),
                            "--task", "copy")
    assert status == 0 and json.loads(lines[0])["exact_match"] == 1.0
