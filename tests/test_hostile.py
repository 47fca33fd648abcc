"""Hostile input end to end (issue 14): crafted checkpoints, run files and Hugging Face directories
through the command line, a full disk, kill -9 at spread-out moments, out-of-range and non-finite
numbers at every numeric command-line option and at the Python API.

Every hostile file or value must end in one line `plainformer: error: ...` naming the file and the
field (or the option), exit status 2, no traceback and no signal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import plainformer as pf
from plainformer import cli
from plainformer import memory as machine_memory
from plainformer.checkpoint import format as checkpoint
from plainformer.checkpoint.format import load_checkpoint
from plainformer.cli import main
from plainformer.data import lm
from plainformer.data.corpus import load_split
from plainformer.data.tokenizers import CharTokenizer
from plainformer.families import memory_estimates as memory
from plainformer.files.atomic import DiskFullError
from plainformer.files.run_lock import RunDirectoryBusy, run_lock
from plainformer.hf.bert import load_hf_bert_tokenizer, save_hf_bert

TINY_GPT = ["--n-layers", "1", "--n-heads", "2", "--d-model", "16", "--d-ff", "32", "--block-size", "8",
            "--batch-size", "2", "--eval-batches", "1", "--eval-interval", "0", "--warmup-steps", "1",
            "--save-interval", "1", "--no-progress"]
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    works = [f"ACT {i}. To be, or not to be, that is the question {i}.\n" * 20 for i in range(5)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n\n".join(works), encoding="utf-8")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus) -> Path:
    """A 3-step tiny GPT run directory (last/ with optimizer state, best/), made by the CLI."""
    out = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLAINFORMER_CACHE", str(out.parent / "cache"))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "3", *TINY_GPT]) == 0
    return out


@pytest.fixture(scope="module")
def hf_bert_dir(tmp_path_factory) -> Path:
    """A tiny Hugging Face BERT directory (config.json, model.safetensors, MiniLM's tokenizer)."""
    directory = tmp_path_factory.mktemp("hf") / "bert"
    tokenizer = load_hf_bert_tokenizer("minilm")
    config = pf.BertConfig(vocab_size=tokenizer.vocab_size, max_len=32, n_layers=1, n_heads=2, d_model=8, d_ff=16)
    torch.manual_seed(0)
    save_hf_bert(pf.BertModel(config), directory, tokenizer=tokenizer)
    return directory


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_one_error_line(code: int, stderr: str, message: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("plainformer: error: ")]
    assert code == 2, stderr
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert re.search(message, errors[0]), errors[0]
    return errors[0]


# ----------------------------------------------------------------------------- crafted checkpoints

def _rewrite_manifest(directory: Path) -> None:
    (directory / "manifest.json").unlink()
    checkpoint._write_manifest(directory)


def _tensors(directory: Path, name: str, edit, metadata: dict | None = None) -> None:
    path = directory / name
    with checkpoint.safe_open(path, "pt") as f:
        kept = f.metadata() if metadata is None else metadata
    save_file(edit(load_file(path)), path, metadata=kept)
    _rewrite_manifest(directory)


def _json(directory: Path, name: str, edit, *, rewrite: bool = True) -> None:
    path = directory / name
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    if rewrite:
        _rewrite_manifest(directory)


def _first(tensors: dict, suffix: str) -> str:
    return sorted(k for k in tensors if k.endswith(suffix))[0]


def _wrong_shape(t: dict) -> dict:
    return {**t, _first(t, ".exp_avg"): torch.zeros(3)}


def _manifest_entry(directory: Path, name: str, entry) -> None:
    _json(directory, "manifest.json", lambda m: {**m, "files": {**m["files"], name: entry}}, rewrite=False)


RESUME, SAMPLE, EVAL = "resume", "sample", "eval"
CHECKPOINT_CASES = {
    "optimizer tensor of the wrong shape (SIGSEGV in fused AdamW)": (
        RESUME, lambda r: _tensors(r / "last", "optimizer.safetensors", _wrong_shape),
        r"optimizer\.safetensors: state\.\d+\.exp_avg has shape \(3,\)"),
    "optimizer step of shape (3,)": (
        RESUME, lambda r: _tensors(r / "last", "optimizer.safetensors",
                                   lambda t: {**t, _first(t, ".step"): torch.zeros(3)}),
        r"state\.\d+\.step must be a float scalar"),
    "optimizer exp_avg as int32": (
        RESUME, lambda r: _tensors(r / "last", "optimizer.safetensors",
                                   lambda t: {**t, _first(t, ".exp_avg"): t[_first(t, ".exp_avg")].int()}),
        r"exp_avg has dtype torch\.int32, expected torch\.float32"),
    "a parameter's optimizer state dropped": (
        RESUME, lambda r: _tensors(r / "last", "optimizer.safetensors",
                                   lambda t: {k: v for k, v in t.items() if k != _first(t, ".exp_avg_sq")}),
        r"the state of parameter \d+ holds \['exp_avg', 'step'\]"),
    "trainer step as a string": (
        RESUME, lambda r: _json(r / "last", "trainer_state.json", lambda s: {**s, "step": "3"}),
        r"trainer_state\.json: step malformed"),
    "int32 weights for a float model": (
        SAMPLE, lambda r: _tensors(r / "best", "model.safetensors",
                                   lambda t: {**t, "blocks.0.ff.W_1.weight": t["blocks.0.ff.W_1.weight"].int()}),
        r"model\.safetensors does not fit GPT: blocks\.0\.ff\.W_1\.weight has dtype torch\.int32"),
    "manifest entry without sha256": (
        SAMPLE, lambda r: _manifest_entry(r / "best", "config.json", {"size": 1}),
        r"manifest\.json: the entry of 'config\.json' must be an object with an integer 'size' and a 'sha256'"),
    "manifest entry outside the checkpoint": (
        SAMPLE, lambda r: _manifest_entry(r / "best", "../../etc/hostname", {"size": 1, "sha256": "0"}),
        r"lists '\.\./\.\./etc/hostname', which is not a file name inside the checkpoint"),
    "alias metadata as a list": (
        SAMPLE, lambda r: _tensors(r / "best", "model.safetensors", lambda t: t,
                                   metadata={"format": "pt", "plainformer.aliases": "[]"}),
        r"'plainformer\.aliases' must map names to names, got \[\]"),
    "format_version as a string": (
        SAMPLE, lambda r: _json(r / "best", "config.json", lambda c: {**c, "format_version": "1"}),
        r"config\.json: 'format_version' has the wrong type \(str\)"),
    "manifest as a list": (
        SAMPLE, lambda r: (r / "best" / "manifest.json").write_text("[]"), r"manifest\.json has no 'files' table"),
    "a model field of the wrong type in config.json": (
        SAMPLE, lambda r: _json(r / "best", "config.json", lambda c: {**c, "model": {**c["model"], "n_layers": "1"}}),
        r"best/config\.json: 'model' does not fit GPTConfig: n_layers must be an int, got str '1'$"),
    "a non-finite model field in config.json": (
        EVAL, lambda r: _json(r / "best", "config.json", lambda c: {**c, "model": {**c["model"], "dropout": 1e999}}),
        r"best/config\.json: 'model' does not fit GPTConfig: dropout must be a finite number, got inf$"),
    "a recipe.yaml value of the wrong type": (
        EVAL, lambda r: (r / "recipe.yaml").write_text("data: 5\n"), r"data in .*recipe\.yaml must be a str, got 5$"),
    "a recipe.yaml model field of the wrong type": (
        RESUME, lambda r: (r / "recipe.yaml").write_text("n_layers: [1]\n"),
        r"n_layers in .*recipe\.yaml must be an int, got list \[1\]$"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_a_hostile_checkpoint_gives_one_error_line(case, capsys, tmp_path, trained_run, corpus, cache):
    command, damage, message = CHECKPOINT_CASES[case]
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    damage(run)
    if command == RESUME:
        argv = ["train", "--data", corpus, "--out", run, "--resume", "--max-steps", "4", *TINY_GPT]
    elif command == EVAL:
        argv = ["eval", "--ckpt", run]
    else:
        argv = ["sample", "--ckpt", run, "--max-new-tokens", "2"]
    assert_one_error_line(*run_cli(capsys, *argv), message)


def test_the_crafted_optimizer_file_is_refused_without_a_signal(tmp_path, trained_run, corpus):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    _tensors(run / "last", "optimizer.safetensors", _wrong_shape)
    result = subprocess.run(
        [sys.executable, "-m", "plainformer", "train", "--data", str(corpus), "--out", str(run), "--resume",
         "--max-steps", "4", *TINY_GPT], capture_output=True, text=True, timeout=300,
        env={**CHILD_ENV, "PLAINFORMER_CACHE": str(trained_run.parent / "cache")})
    assert result.returncode == 2, result.stderr  # a signal would be negative
    assert_one_error_line(result.returncode, result.stderr, r"exp_avg has shape \(3,\)")


def test_a_metrics_line_without_step_does_not_stop_a_resume(capsys, tmp_path, trained_run, corpus, cache):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"val_loss": 1.0}\n')
    code, _ = run_cli(capsys, "train", "--data", corpus, "--out", run, "--resume", "--max-steps", "4", *TINY_GPT)
    assert code == 0
    assert all("step" in json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())


# ----------------------------------------------------------------------------- Hugging Face directories

class Payload:
    """What a hostile pickle carries: code to run on load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_bin(d: Path) -> None:
    (d / "model.safetensors").unlink()
    torch.save({"embeddings.word_embeddings.weight": Payload(d / "PWNED")}, d / "pytorch_model.bin")


HF_CASES = {
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{oops"), r"config\.json is not valid JSON"),
    "config.json a list": (lambda d: (d / "config.json").write_text("[]"), r"config\.json must hold a JSON object"),
    "garbage model.safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"\x10" * 64),
                                  r"model\.safetensors is not a valid safetensors file"),
    "int32 weights": (lambda d: save_file({k: v.int() for k, v in load_file(d / "model.safetensors").items()},
                                          d / "model.safetensors"), r"holds non-floating-point weights"),
    "hostile pytorch_model.bin": (_hostile_bin, r"pytorch_model\.bin is not loadable safely .*; "
                                                r"convert it to model\.safetensors$"),
    "pytorch_model.bin holding a list": (lambda d: ((d / "model.safetensors").unlink(),
                                                    torch.save([torch.zeros(1)], d / "pytorch_model.bin")),
                                         r"pytorch_model\.bin does not hold a state dict"),
    "garbage pytorch_model.bin": (lambda d: ((d / "model.safetensors").unlink(),
                                             (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 junk")),
                                  r"pytorch_model\.bin is not a readable PyTorch weights file"),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_a_hostile_hugging_face_directory_gives_one_error_line(case, capsys, tmp_path, hf_bert_dir):
    damage, message = HF_CASES[case]
    directory = tmp_path / "bert"
    shutil.copytree(hf_bert_dir, directory)
    damage(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, stderr = run_cli(capsys, "embed", "hello", "--model", directory)
    line = assert_one_error_line(code, stderr, message)
    assert "weights_only" not in stderr and not (directory / "PWNED").exists(), line


def test_the_tiny_hugging_face_directory_itself_embeds(capsys, hf_bert_dir):
    code, _ = run_cli(capsys, "embed", "hello", "--model", hf_bert_dir)
    assert code == 0


@pytest.mark.parametrize("integer", [False, True])
def test_a_bert_checkpoint_with_integer_weights_is_refused_by_embed(capsys, tmp_path, hf_bert_dir, integer):
    bert = pf.load_hf_bert(hf_bert_dir)
    checkpoint.save_checkpoint(tmp_path / "ckpt", model=bert, family="bert", model_config=bert.config.to_dict(),
                               tokenizer=load_hf_bert_tokenizer(hf_bert_dir))
    if integer:
        _tensors(tmp_path / "ckpt", "model.safetensors", lambda t: {k: v.int() for k, v in t.items()})
        assert_one_error_line(*run_cli(capsys, "embed", "hello", "--model", tmp_path / "ckpt"),
                              r"model\.safetensors does not fit BertModel: .* has dtype torch\.int32")
    else:
        assert run_cli(capsys, "embed", "hello", "--model", tmp_path / "ckpt")[0] == 0


# ----------------------------------------------------------------------------- a full disk

FULL = checkpoint.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_while_checkpointing_is_one_line_and_the_last_checkpoint_survives(
        capsys, tmp_path, trained_run, corpus, cache, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)

    def full(*args, **kwargs):
        raise FULL

    monkeypatch.setattr(checkpoint, "save_file", full)
    code, stderr = run_cli(capsys, "train", "--data", corpus, "--out", run, "--resume", "--max-steps", "4",
                           *TINY_GPT)
    assert_one_error_line(code, stderr, rf"the disk is full: could not write checkpoint {run / 'last'}")
    monkeypatch.undo()
    assert load_checkpoint(run / "last").trainer_state["step"] == 3
    assert not list(run.glob(".*.tmp-*"))


def test_a_full_disk_while_writing_hugging_face_weights_is_one_error(tmp_path, hf_bert_dir, monkeypatch):
    from plainformer.hf import bert as hf_bert

    def full(*args, **kwargs):
        raise FULL

    monkeypatch.setattr(hf_bert, "save_file", full)
    with pytest.raises(DiskFullError, match=f"could not write weights {tmp_path / 'out' / 'model.safetensors'}"):
        save_hf_bert(pf.load_hf_bert(hf_bert_dir), tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


class FullFile(io.BytesIO):
    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_caching_tokens_is_one_error_and_leaves_no_file(tmp_path, monkeypatch):
    split = load_split(None)
    monkeypatch.setattr(lm, "open", lambda path, mode: FullFile(), raising=False)
    with pytest.raises(DiskFullError, match=r"the disk is full: could not write the token cache .*\.bin; "):
        lm.token_array(split, "val", CharTokenizer(split.text), cache_dir=tmp_path)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_really_full_disk_under_the_token_cache_is_one_error_line(capsys, small_tmpfs, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAINFORMER_CACHE", str(small_tmpfs))
    text = tmp_path / "big.txt"
    text.write_text("\n\n\n".join(f"Work {i}. " + "all the world's a stage " * 3000 for i in range(4)))
    code, stderr = run_cli(capsys, "train", "--data", text, "--out", tmp_path / "run", "--max-steps", "1",
                           *TINY_GPT)
    assert_one_error_line(code, stderr, rf"the disk is full: could not write the token cache {small_tmpfs}/")
    assert not list(small_tmpfs.rglob("*.tmp"))


# ----------------------------------------------------------------------------- kill -9

CHILD = """
import sys, time
import torch
import plainformer as pf
from plainformer.training.config import TrainConfig
from plainformer.training.trainer import Trainer

class Counting:
    def get_batch(self, split, index, batch_size):
        if split == "train":
            print(index, flush=True)
            time.sleep(0.01)
        g = torch.Generator().manual_seed(2 * index + (split == "val"))
        x = (torch.randint(11, (batch_size, 1), generator=g) + torch.arange(9)) % 11  # (B, T + 1)
        return {"idx": x[:, :-1], "targets": x[:, 1:]}

torch.set_num_threads(1)
torch.manual_seed(0)
model = pf.GPT(pf.GPTConfig(vocab_size=11, block_size=8, n_layers=1, n_heads=2, d_model=16, d_ff=32, dropout=0.1))
config = TrainConfig(max_steps=16, batch_size=4, lr=1e-2, min_lr=1e-3, warmup_steps=2, log_interval=4,
                     eval_interval=7, eval_batches=2, save_interval=1, seed=3)
Trainer(model, Counting(), config, sys.argv[1], resume=sys.argv[2] == "resume", progress=False).fit()
"""
DETERMINISTIC = ("step", "train_loss", "val_loss", "lr", "grad_norm")


def _child(out: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(out), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=CHILD_ENV)


def _logged(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k in DETERMINISTIC} for line in lines]


def _finish(child: subprocess.Popen) -> None:
    _, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr.decode()


def test_kill_9_at_spread_out_moments_loses_nothing(tmp_path):
    _finish(_child(tmp_path / "reference", "fresh"))
    out, rng = tmp_path / "run", random.Random(14)
    for target, mode in ((3, "fresh"), (8, "resume"), (13, "resume")):
        child = _child(out, mode)
        try:
            while int(child.stdout.readline() or -1) < target:
                assert child.poll() is None, child.stderr.read().decode()
            with pytest.raises(RunDirectoryBusy, match=f"pid {child.pid}"), run_lock(out):
                pass
            time.sleep(rng.uniform(0, 0.02))  # somewhere in a step: training, saving or logging
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        assert child.returncode == -signal.SIGKILL
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "loading .last.old": a kill between the two renames
            assert load_checkpoint(out / "last").trainer_state["step"] >= 1
    _finish(_child(out, "resume"))
    assert _logged(out) == _logged(tmp_path / "reference")
    assert not list(out.glob(".*.tmp-*")) and not (out / ".last.old").exists()
    with run_lock(out):  # free again
        pass


# ----------------------------------------------------------------------------- numbers at the command line

NUMERIC_OPTIONS = {
    "eval --batch-size -2 (evaluated 11 tokens of 4,827)": (["eval", "--batch-size", "-2"], "--batch-size", "-2"),
    "eval --batch-size 0 (range() arg 3 must not be zero)": (["eval", "--batch-size", "0"], "--batch-size", "0"),
    "eval --beam 0": (["eval", "--beam", "0"], "--beam", "0"),
    "eval --length-penalty nan": (["eval", "--length-penalty", "nan"], "--length-penalty", "nan"),
    "eval --threads 0": (["eval", "--threads", "0"], "--threads", "0"),
    "sample --temperature nan (crashed in torch.multinomial)": (
        ["sample", "--temperature", "nan"], "--temperature", "nan"),
    "sample --temperature inf": (["sample", "--temperature", "inf"], "--temperature", "inf"),
    "sample --temperature -1": (["sample", "--temperature", "-1"], "--temperature", "-1"),
    "sample --top-k 0": (["sample", "--top-k", "0"], "--top-k", "0"),
    "sample --top-p 1.5": (["sample", "--top-p", "1.5"], "--top-p", "1.5"),
    "sample --top-p 0": (["sample", "--top-p", "0"], "--top-p", "0"),
    "sample --max-new-tokens -1": (["sample", "--max-new-tokens", "-1"], "--max-new-tokens", "-1"),
    "sample --seed -1": (["sample", "--seed", "-1"], "--seed", "-1"),
    "sample --seed 2**64 (overflows torch's generator)": (["sample", "--seed", str(2**64)], "--seed", str(2**64)),
    "translate --beam 0": (["translate", "--beam", "0", "hi"], "--beam", "0"),
    "translate greedy --length-penalty -1 (refused for beam > 1 only)": (
        ["translate", "--length-penalty", "-1", "hi"], "--length-penalty", "-1"),
    "translate --threads 0": (["translate", "--threads", "0", "hi"], "--threads", "0"),
}
OPTIONS_WITHOUT_CKPT = {
    "search --k 0": (["search", "--k", "0", "--corpus", "c.txt", "q"], "--k", "0"),
    "embed --batch-size 0": (["embed", "--batch-size", "0", "hi"], "--batch-size", "0"),
    "prepare --val-fraction 1": (["prepare", "--val-fraction", "1"], "--val-fraction", "1"),
    "prepare --val-fraction nan": (["prepare", "--val-fraction", "nan"], "--val-fraction", "nan"),
    "prepare --bpe-vocab-size 0": (["prepare", "--bpe-vocab-size", "0"], "--bpe-vocab-size", "0"),
    "train --threads 0": (["train", "--threads", "0"], "--threads", "0"),
    "train --vocab-size -5": (["train", "--vocab-size", "-5"], "--vocab-size", "-5"),
    "train --seq-len 0": (["train", "--preset", "bert-pretrain", "--seq-len", "0"], "--seq-len", "0"),
    "train --nproc 0": (["train", "--nproc", "0"], "--nproc", "0"),
}


@pytest.mark.parametrize("case", [*NUMERIC_OPTIONS, *OPTIONS_WITHOUT_CKPT])
def test_an_out_of_range_or_non_finite_option_gives_one_error_line(case, capsys, tmp_path):
    if case in NUMERIC_OPTIONS:
        argv, option, value = NUMERIC_OPTIONS[case]
        argv = [*argv, "--ckpt", tmp_path / "no-run"]  # refused before any file is read
    else:
        argv, option, value = OPTIONS_WITHOUT_CKPT[case]
    code, stderr = run_cli(capsys, *argv)
    line = assert_one_error_line(code, stderr, rf"^plainformer: error: argument {option}: expected .*, "
                                               rf"got '{re.escape(value)}' \(see `plainformer {argv[0]} --help`\)$")
    assert "usage:" not in stderr, line


def test_an_argparse_mistake_is_one_error_line_too(capsys):
    assert_one_error_line(*run_cli(capsys, "eval"), r"the following arguments are required: --ckpt")
    assert_one_error_line(*run_cli(capsys, "sample", "--ckpt", "x", "--tempreature", "1"),
                          r"unrecognized arguments: --tempreature 1 \(see `plainformer sample --help`\)$")
    assert_one_error_line(*run_cli(capsys, "--bogus", "sample", "--ckpt", "x"),
                          r"unrecognized arguments: --bogus \(see `plainformer --help`\)$")


def _float_flags() -> list[tuple[str, str]]:
    """(flag, a preset whose configs have it) for every float field that `train` takes as a flag."""
    from plainformer import families, recipes
    from plainformer.cli.train import recipe_keys
    from plainformer.training.config import TrainConfig

    presets = {family.name: recipes.names(family.name)[0] for family in families.trained()}
    flags = {}
    for family, config_cls in [*((f.name, f.config) for f in families.trained()), ("gpt", TrainConfig)]:
        for field in dataclasses.fields(config_cls):
            if field.name in recipe_keys() and "float" in str(field.type) and field.name not in flags:
                flags[field.name] = presets[family]
    assert {"lr", "dropout", "rope_base", "label_smoothing", "max_time"} <= set(flags)
    return sorted(flags.items())


@pytest.mark.parametrize("field, preset", _float_flags())
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_config_flag_is_refused_before_training(field, preset, value, capsys, tmp_path, cache):
    flag = "--" + field.replace("_", "-")
    code, stderr = run_cli(capsys, "train", "--preset", preset, flag, value, "--out", tmp_path / "run",
                           "--max-steps", "1")  # should it train after all: briefly
    assert_one_error_line(code, stderr, rf"^plainformer: error: {field} must be a finite number, got {value}$")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("values, message", [
    (dict(n_layers="2"), r"n_layers must be an int, got str '2'"),
    (dict(n_layers=2.0), r"n_layers must be an int, got float 2\.0"),
    (dict(bias=1), r"bias must be a bool, got int 1"),
    (dict(rope_base="1e4"), r"rope_base must be a number, got str"),
    (dict(rope_base=math.inf), r"rope_base must be a finite number, got inf"),
    (dict(n_kv_heads="1"), r"n_kv_heads must be an int or None, got str"),
])
def test_a_config_field_of_the_wrong_type_is_named_with_the_type_expected(values, message):
    """Before the field-by-field checks: no `'>' not supported between instances of 'str' and 'int'`."""
    base = dict(vocab_size=11, block_size=8, n_layers=1, n_heads=2, d_model=16, d_ff=32)
    with pytest.raises((TypeError, ValueError), match=message):
        pf.GPTConfig.from_dict({**base, **values})


# ----------------------------------------------------------------------------- run files at the command line

ONE_TOKEN_VALIDATION = "To be, or not to be, that is the question.\nT"  # validation: the last line, "T"


def test_a_one_token_validation_split_is_one_error_line(capsys, tmp_path, trained_run, cache):
    data = tmp_path / "tiny.txt"
    data.write_text(ONE_TOKEN_VALIDATION)
    assert_one_error_line(*run_cli(capsys, "eval", "--ckpt", trained_run, "--data", data),
                          r"the validation split has 1 token\(s\); next-token loss needs at least 2")
    assert_one_error_line(*run_cli(capsys, "train", "--data", data, "--out", tmp_path / "run", *TINY_GPT),
                          r"the val split has 1 tokens but block_size=8 needs at least 9")


def test_a_run_holding_only_the_copy_an_interrupted_save_left_is_found(capsys, tmp_path, trained_run, cache):
    """A save killed between its two renames leaves RUN/.last.old and no RUN/last (io/checkpoint.py)."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    shutil.rmtree(run / "best")
    (run / "last").rename(run / ".last.old")
    code = main(["eval", "--ckpt", str(run)])
    out, err = capsys.readouterr()
    assert code == 0 and f"loading {run / '.last.old'}, left by a save that was interrupted" in err, err
    assert main(["eval", "--ckpt", str(trained_run / "last")]) == 0
    assert json.loads(out) == json.loads(capsys.readouterr().out)
    assert run_cli(capsys, "sample", "--ckpt", run, "--max-new-tokens", "2")[0] == 0


def _transformer_run(directory: Path) -> Path:
    """A run directory whose best/ holds an untrained tiny encoder-decoder, and no recipe.yaml."""
    torch.manual_seed(0)
    model = pf.Transformer(pf.TransformerConfig(src_vocab_size=11, tgt_vocab_size=11, n_layers=1, n_heads=2,
                                                d_model=8, d_ff=16, max_len=16))
    checkpoint.save_checkpoint(directory / "best", model=model, family="transformer",
                               model_config=model.config.to_dict())
    return directory


@pytest.mark.parametrize("text, message", [
    ("{oops", r"task\.json is not valid JSON: Expecting property name"),
    ('"copy"', r"task\.json must hold an object whose 'task' is one of copy, reverse, numbers-en-fr, "
               r"got \"copy\"$"),
    ('{"task": ["copy"]}',
     r"task\.json must hold an object whose 'task' is one of .*, got \{\"task\": \[\"copy\"\]\}$"),
    ('{"name": "copy"}', r"task\.json must hold an object whose 'task' is one of"),
])
def test_an_invalid_task_json_is_one_error_line_naming_it(text, message, capsys, tmp_path):
    run = _transformer_run(tmp_path / "run")
    (run / "task.json").write_text(text)
    line = assert_one_error_line(*run_cli(capsys, "eval", "--ckpt", run), message)
    assert str(run / "task.json") in line


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_refused_by_the_lock_leaves_the_owners_recipe_alone(resume, capsys, tmp_path, trained_run, corpus,
                                                                   cache):
    run = tmp_path / "run"
    if resume:
        shutil.copytree(trained_run, run)
    recipe = (run / "recipe.yaml").read_bytes() if resume else None
    argv = ["train", "--data", corpus, "--out", run, "--max-steps", "5", *TINY_GPT, *(["--resume"] * resume)]
    with run_lock(run):
        assert_one_error_line(*run_cli(capsys, *argv), rf"{run} is in use by another run \(pid {os.getpid()}\)")
    if resume:
        assert (run / "recipe.yaml").read_bytes() == recipe
    else:
        assert not (run / "recipe.yaml").exists()
    code, _ = run_cli(capsys, *argv)  # and the lock's owner does write it
    assert code == 0 and "max_steps: 5" in (run / "recipe.yaml").read_text()


# ----------------------------------------------------------------------------- the search embeddings cache

def _cached_object_array(path: Path) -> None:
    np.save(path, np.array([Payload(path.parent / "PWNED")], dtype=object), allow_pickle=True)


SEARCH_CACHES = {
    "garbage": lambda path: path.write_bytes(b"\x10" * 64),
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:-9]),
    "empty": lambda path: path.write_bytes(b""),
    "a pickled object array": _cached_object_array,
    "float64": lambda path: np.save(path, np.load(path).astype(np.float64)),
    "NaN": lambda path: np.save(path, np.full_like(np.load(path), np.nan)),
}


@pytest.mark.parametrize("case", list(SEARCH_CACHES))
def test_a_corrupt_search_cache_is_computed_again(case, capsys, tmp_path, hf_bert_dir):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Good night, sweet prince.\nThe rest is silence.\nTo be, or not to be.\n")
    argv = ["search", "--corpus", corpus, "--model", hf_bert_dir, "--cache-dir", tmp_path / "cache", "--json",
            "silence"]

    def search() -> dict:
        assert main([str(a) for a in argv]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])

    first = search()
    [cache] = (tmp_path / "cache").iterdir()
    SEARCH_CACHES[case](cache)
    again = search()
    assert again["results"] == first["results"] and not again["cached"]
    assert not (tmp_path / "cache" / "PWNED").exists()
    assert np.load(cache, allow_pickle=False).dtype == np.float32  # written again, whole
    assert search()["cached"]


# ----------------------------------------------------------------------------- numbers at the API

def _gpt() -> pf.GPT:
    torch.manual_seed(0)
    return pf.GPT(pf.GPTConfig(vocab_size=11, block_size=8, n_layers=1, n_heads=2, d_model=16, d_ff=32))


@pytest.mark.parametrize("call, error, message", [
    (lambda: pf.scaled_dot_product_attention(*torch.randn(3, 1, 4, 8), scale=math.nan), ValueError, "scale must be"),
    (lambda: pf.scaled_dot_product_attention(*torch.randn(3, 1, 4, 8), scale=math.inf), ValueError, "scale must be"),
    (lambda: _gpt()(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4)), TypeError,
     r"targets must hold token ids as torch\.long, got torch\.float32"),
    (lambda: _gpt()(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.int32)), TypeError,
     r"targets must hold token ids as torch\.long"),
    (lambda: _gpt().generate(torch.zeros(1, 2, dtype=torch.long), 3, temperature=math.nan), ValueError,
     r"temperature must be a number >= 0 \(0 = greedy\) and finite, got nan"),
    (lambda: pf.sample_next(torch.randn(2, 5), temperature=math.inf), ValueError, "temperature must be"),
    (lambda: pf.sample_next(torch.full((2, 5), -math.inf)), ValueError,
     r"logits rows \[0, 1\] hold NaN or \+inf, or only -inf: there is no distribution to sample from"),
    (lambda: pf.sample_next(torch.tensor([[0.0, 1.0], [math.nan, 0.0]])), ValueError, r"logits rows \[1\]"),
    (lambda: pf.sample_next(torch.tensor([[math.inf, 0.0]])), ValueError, r"logits rows \[0\]"),
])
def test_non_finite_and_mistyped_numbers_are_refused_at_the_api(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_sampling_with_some_minus_inf_logits_draws_only_the_finite_ones():
    logits = torch.tensor([[-math.inf, 0.0, -math.inf], [1.0, -math.inf, 1.0]]).repeat(50, 1)
    drawn = pf.sample_next(logits, generator=torch.Generator().manual_seed(0))
    assert set(drawn[0::2].tolist()) == {1} and set(drawn[1::2].tolist()) == {0, 2}


def test_pickle_payload_would_run_if_unpickled(tmp_path):
    """The hostile file above is really hostile: plain pickle runs its payload."""
    marker = tmp_path / "PWNED"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


# ----------------------------------------------------------------------------- round two (issue 28)

def test_a_diverging_run_stops_naming_the_step_and_saves_no_best_from_a_nan_loss(capsys, tmp_path, corpus, cache):
    out = tmp_path / "run"
    code, stderr = run_cli(capsys, "train", "--data", corpus, "--out", out, "--lr", "1e30", "--max-steps", "30",
                           "--no-fit-to-time", *TINY_GPT)
    assert_one_error_line(code, stderr, r"training diverged at step \d+: the loss or the gradient norm is NaN")
    for name in ("last", "best"):
        if (out / name).exists():
            state = checkpoint.load_checkpoint(out / name).trainer_state
            assert state["best_val_loss"] is None or math.isfinite(state["best_val_loss"])


ROUND_TWO_CONFIGS = {
    "60000 nested brackets": ("c.json", "[" * 60_000, r"c\.json is not valid JSON: it nests too deeply"),
    "100000 nested brackets": ("c.json", "[" * 100_000, r"c\.json is larger than a config file of flags may be"),
    "a YAML key given twice": ("c.yaml", "lr: 0.1\nlr: 0.2\n", r"the key 'lr' is given twice"),
    "a JSON key given twice": ("c.json", '{"lr": 0.1, "lr": 0.2}', r"the key 'lr' is given twice"),
    "a key with dashes and underscores": ("c.yaml", "n-layers: 1\nn_layers: 2\n", r"gives n_layers twice"),
}


@pytest.mark.parametrize("case", list(ROUND_TWO_CONFIGS))
def test_a_hostile_config_file_gives_one_error_line(case, capsys, tmp_path):
    name, text, message = ROUND_TWO_CONFIGS[case]
    (tmp_path / name).write_text(text)
    assert_one_error_line(*run_cli(capsys, "train", "--config", tmp_path / name), message)


@pytest.mark.parametrize("argv, message", [
    (["train", "--config", "/dev/zero"], r"--config /dev/zero is not a regular file"),
    (["train", "--data", ""], r"--data must name a file, folder or glob, got ''"),
    (["train", "--text-field", "body"], r"--text-field names the field of JSON Lines records .*bundled corpus"),
])
def test_an_unclear_option_is_now_one_clear_line(capsys, argv, message):
    assert_one_error_line(*run_cli(capsys, *argv), message)


def test_out_naming_a_file_is_refused_before_the_data_is_prepared(capsys, tmp_path, cache):
    (tmp_path / "taken").write_text("mine")
    assert_one_error_line(*run_cli(capsys, "train", "--out", tmp_path / "taken"), r"--out .*taken is a file")
    assert not cache.exists()  # nothing was prepared


def test_a_shard_index_whose_weight_map_is_a_list_is_one_error(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model-1.safetensors"]}))
    with pytest.raises(ValueError, match="weight_map must map weight names to shard file names"):
        pf.load_hf(tmp_path)
    assert_one_error_line(*run_cli(capsys, "export", "--ckpt", tmp_path, "--out", tmp_path / "out"),
                          "weight_map must map")


@pytest.mark.parametrize("call, error, message", [
    (lambda: _gpt()(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), 11)), ValueError,
     r"targets must hold token ids in \[0, 11\) or IGNORE_INDEX \(-100\)"),
    (lambda: pf.MultiHeadAttention(8, 2)(*torch.randn(3, 1, 4, 8, dtype=torch.float64)), TypeError,
     r"query is torch\.float64 but the layer's weights are torch\.float32"),
])
def test_raw_torch_errors_are_now_named_at_the_api(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_targets_that_are_all_ignored_give_a_zero_loss_not_nan():
    _, loss = _gpt()(torch.zeros(2, 4, dtype=torch.long), torch.full((2, 4), -100))
    assert loss.item() == 0.0
    loss.backward()  # and gradients of zero, not NaN


@pytest.mark.parametrize("config, message", [
    (None, r"holds neither a plainformer checkpoint or run \(manifest\.json, best/, last/\) nor a Hugging Face"),
    ("{not json", r"config\.json is not a Hugging Face config \(JSON\)"),
    ('{"a": 1}', r"config\.json has no model_type: not a Hugging Face model"),
    ('{"model_type": "gpt2", "n_embd": null, "n_head": 2}', r"n_embd must be a positive integer, got None"),
    ('{"model_type": "bert", "hidden_size": -4}', r"config\.json: hidden_size must be a positive integer, got -4"),
    ('{"model_type": "llama", "hidden_size": null}', r"hidden_size must be a positive integer, got None"),
])
@pytest.mark.parametrize("verb", ["export", "sample", "eval"])
def test_a_directory_with_a_bad_or_no_config_says_what_is_wrong(verb, config, message, capsys, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    if config is not None:
        (model / "config.json").write_text(config)
    argv = {"export": ["--out", tmp_path / "out"], "sample": [], "eval": []}[verb]
    assert_one_error_line(*run_cli(capsys, verb, "--ckpt", model, *argv), message)


# ---- round two, B: sizes checked before memory is spent

# Runs every case in one child whose address space is capped at what it holds plus 2 GiB (RLIMIT_AS), so
# that a size no longer checked fails fast there instead of exhausting the machine: argv through
# `main`, or ["GPT", {fields}] built through the API. Prints {case: [exit status, stderr]} as JSON.
SIZES_CHILD = r"""
import contextlib, io, json, resource, sys
import plainformer as pf
from plainformer.cli import main
from plainformer.memory import _meminfo
_, hard = resource.getrlimit(resource.RLIMIT_AS)
cap = _meminfo("/proc/self/status", "VmSize") + 2 * 2**30
resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
results = {}
for name, case in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        if isinstance(case[0], str):
            code = main(case)
        else:
            try:
                getattr(pf, case[0][0])(getattr(pf, case[0][0] + "Config")(**case[0][1]))
                code = 0
            except Exception as error:
                code, _ = 2, err.write(f"{type(error).__name__}: {error}")
    results[name] = [code, err.getvalue()]
print(json.dumps(results))
"""


def _hf_config(directory: Path, values: dict) -> Path:
    """A Hugging Face directory holding only config.json: the model is refused before weights are read."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(values))
    return directory


def _hf_bert_with(directory: Path, hf_bert_dir: Path, **changes) -> Path:
    shutil.copytree(hf_bert_dir, directory)
    _json(directory, "config.json", lambda c: {**c, **changes}, rewrite=False)
    return directory


SIZE_CASES = (
    "--config with n_layers: 10000 (a 2B-parameter model)",
    "a checkpoint whose config.json says n_layers: 100000 (sample)",
    "a checkpoint whose config.json says n_layers: 100000 (resume)",
    "a Llama of num_hidden_layers: 100000", "a Hugging Face GPT-2 of n_layer: 100000",
    "pf.GPT of n_layers=10**6", "--block-size 1e9", "a Llama of max_position_embeddings: 1e9 (a 64 GB rotary table)",
    "a Hugging Face BERT of max_position_embeddings: 1e9", "--d-model 1e7", "--d-ff 1e9",
    "--vocab-size 1e9 for a BPE tokenizer", "pf.GPT of vocab_size=10**9", "--batch-size 1e8",
    "a 20-digit --batch-size (a C++ frame dump after the data and the run directory)", "--eval-batch-size 1e12",
    "sample --num-samples 1e8", "translate --beam 100000", "eval --beam 100000")


def _size_cases(tmp: Path, corpus: Path, trained_run: Path, hf_bert_dir: Path) -> dict:
    """Each of SIZE_CASES -> (argv or [[model, fields]], the one error line expected)."""
    (tmp / "deep.yaml").write_text("n_layers: 10000\n")
    tall = tmp / "tall-run"
    shutil.copytree(trained_run, tall)
    for name in ("best", "last"):
        _json(tall / name, "config.json", lambda c: {**c, "model": {**c["model"], "n_layers": 100_000}})
    llama = dict(model_type="llama", hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                 intermediate_size=32, vocab_size=50)
    gpt2 = dict(model_type="gpt2", n_layer=100_000, n_head=2, n_embd=16, vocab_size=50, n_positions=8)
    seq2seq = _transformer_run(tmp / "seq2seq")

    def train(name: str, *argv: object) -> list[str]:
        return ["train", "--data", str(corpus), "--out", str(tmp / "runs" / name), *map(str, argv)]

    training = r"training needs ~\S+ \S+ \(the model, its gradients, Muon's state and the activations of a batch of "
    unbuilt = r"the model needs ~[\d.]+ \S+ for its parameters and buffers, more than the [\d.]+ [GM]B available"
    return {
        "--config with n_layers: 10000 (a 2B-parameter model)": (
            train("deep", "--config", tmp / "deep.yaml"), rf"^n_layers=10000: {training}16 x 128 tokens\), more "
                                                          r"than the [\d.]+ [GM]B available \(--max-memory SIZE"),
        "a checkpoint whose config.json says n_layers: 100000 (sample)": (
            ["sample", "--ckpt", str(tall)], r"config\.json describes a model of 259,200,400 parameters but "
                                             r".*model\.safetensors holds 2,992 values"),
        "a checkpoint whose config.json says n_layers: 100000 (resume)": (
            ["train", "--resume", "--out", str(tall), "--data", str(corpus)], r"config\.json describes a model of"),
        "a Llama of num_hidden_layers: 100000": (
            ["export", "--ckpt", str(_hf_config(tmp / "llama-tall", {**llama, "num_hidden_layers": 100_000})),
             "--out", str(tmp / "out")], rf"^n_layers=100000: {unbuilt}"),
        "a Hugging Face GPT-2 of n_layer: 100000": (
            ["export", "--ckpt", str(_hf_config(tmp / "gpt2-tall", gpt2)), "--out", str(tmp / "out")],
            rf"^n_layers=100000: {unbuilt}"),
        "pf.GPT of n_layers=10**6": ([["GPT", {"n_layers": 10**6}]], r"^MemoryBudgetError: n_layers=1000000: the "
                                                                     r"model needs ~7\.1 TB"),
        "--block-size 1e9": (train("long", "--block-size", 10**9), rf"^block_size=1000000000: {training}"),
        "a Llama of max_position_embeddings: 1e9 (a 64 GB rotary table)": (
            ["export", "--ckpt", str(_hf_config(tmp / "llama-long", {**llama, "max_position_embeddings": 10**9})),
             "--out", str(tmp / "out")], r"^block_size=1000000000: the model needs ~64\.0 GB"),
        "a Hugging Face BERT of max_position_embeddings: 1e9": (
            ["export", "--ckpt", str(_hf_bert_with(tmp / "hf-long", hf_bert_dir, max_position_embeddings=10**9)),
             "--out", str(tmp / "out")], rf"^max_len=1000000000: {unbuilt}"),
        "--d-model 1e7": (train("wide", "--d-model", 10**7), rf"^d_model=10000000: {training}"),
        "--d-ff 1e9": (train("ffn", "--d-ff", 10**9), rf"^d_ff=1000000000: {training}"),
        "--vocab-size 1e9 for a BPE tokenizer": (
            train("vocab", "--tokenizer", "bpe", "--vocab-size", 10**9), rf"^vocab_size=1000000000: {training}"),
        "pf.GPT of vocab_size=10**9": ([["GPT", {"vocab_size": 10**9}]], r"^MemoryBudgetError: vocab_size=1000000000"),
        "--batch-size 1e8": (train("batch", "--batch-size", 10**8), rf"^batch_size=100000000: {training}100000000 x"),
        "a 20-digit --batch-size (a C++ frame dump after the data and the run directory)": (
            train("digits", "--batch-size", "99999999999999999999"), rf"^batch_size=99999999999999999999: {training}"),
        "--eval-batch-size 1e12": (train("eval", "--eval-batch-size", 10**12),
                                   rf"^eval_batch_size=1000000000000: {training}"),
        "sample --num-samples 1e8": (["sample", "--ckpt", str(trained_run), "--num-samples", str(10**8)],
                                     r"^sampling 100000000 row\(s\) at once .* KV cache of 8 positions"),
        "translate --beam 100000": (["translate", "--ckpt", str(seq2seq), "--beam", "100000", "hello"],
                                    r"^--beam 100000 is more than the 11 tokens of the target vocabulary: at most "
                                    r"--beam 11$"),
        "eval --beam 100000": (["eval", "--ckpt", str(seq2seq), "--task", "copy", "--beam", "100000"],
                               r"^--beam 100000 is more than the 11 tokens"),
    }


@pytest.fixture(scope="module")
def size_refusals(tmp_path_factory, corpus, trained_run, hf_bert_dir) -> tuple[dict, dict, Path]:
    """(cases, {case: [exit status, stderr]}, the child's cache) of every case run in one capped child."""
    tmp = tmp_path_factory.mktemp("sizes")
    cases = _size_cases(tmp, corpus, trained_run, hf_bert_dir)
    assert list(cases) == list(SIZE_CASES)
    child = subprocess.run([sys.executable, "-c", SIZES_CHILD, json.dumps({k: v[0] for k, v in cases.items()})],
                           capture_output=True, text=True, timeout=300,
                           env={**CHILD_ENV, "PLAINFORMER_CACHE": str(tmp / "cache")})
    assert child.returncode == 0, child.stderr[-3000:]
    return cases, json.loads(child.stdout.splitlines()[-1]), tmp


@pytest.mark.parametrize("case", SIZE_CASES)
def test_a_size_too_big_for_the_memory_is_one_line_before_memory_is_spent(case, size_refusals):
    cases, results, tmp = size_refusals
    (argv, message), (code, stderr) = cases[case], results[case]
    if isinstance(argv[0], str):  # "^": where the line's message begins
        assert_one_error_line(code, stderr, re.sub(r"^\^", "^plainformer: error: ", message))
    else:
        assert code == 2 and re.search(message, stderr), stderr
    assert not (tmp / "runs").exists() and not (tmp / "cache").exists() and not (tmp / "out").exists()


def test_max_memory_lets_a_run_that_the_machine_would_refuse_proceed(capsys, tmp_path, corpus, cache, monkeypatch):
    monkeypatch.setattr(machine_memory, "_machine_available", lambda: 10_000)  # a machine with 10 kB to spare
    argv = ["train", "--data", corpus, "--out", tmp_path / "run", "--max-steps", "1", *TINY_GPT]
    assert_one_error_line(*run_cli(capsys, *argv), r"training needs ~[\d.]+ kB .*, more than the 10\.0 kB "
                                                   r"available \(--max-memory SIZE to allow more\)$")
    assert not (tmp_path / "run").exists() and not cache.exists()
    code, stderr = run_cli(capsys, *argv, "--max-memory", "1GB")
    assert code == 0, stderr
    assert load_checkpoint(tmp_path / "run" / "last").trainer_state["step"] == 1


@pytest.mark.parametrize("value", ["12XB", "0", "-1GB", "lots", "1e9"])
def test_a_max_memory_that_is_no_size_is_one_line(value, capsys):
    assert_one_error_line(*run_cli(capsys, "train", f"--max-memory={value}"),
                          rf"argument --max-memory: expected a size such as 64GB or 512MiB, got '{value}'")


@pytest.mark.parametrize("verb", ["train", "sample", "eval", "translate", "serve"])
@pytest.mark.parametrize("value", ["99999999999999999999999TB", "9" * 400, "1.1GB"])
def test_a_max_memory_past_the_machines_ram_and_swap_is_one_line(verb, value, capsys, monkeypatch):
    monkeypatch.setattr(cli, "machine_memory", lambda: 10**9)  # a machine of 1 GB with its swap
    assert_one_error_line(*run_cli(capsys, verb, f"--max-memory={value}"),
                          rf"argument --max-memory: {value} is more than this machine has: 1\.0 GB of RAM and swap")


def test_a_beam_the_memory_cannot_hold_is_refused_naming_the_largest_that_fits(capsys, tmp_path):
    torch.manual_seed(0)
    config = pf.TransformerConfig(src_vocab_size=5000, tgt_vocab_size=5000, n_layers=1, n_heads=2, d_model=8,
                                  d_ff=16, max_len=16)
    checkpoint.save_checkpoint(tmp_path / "run" / "best", model=pf.Transformer(config), family="transformer",
                               model_config=config.to_dict())
    limit = memory.model_bytes(config) + memory.beam_search_bytes(config, 1, 100, 16)  # 100 hypotheses and more
    argv = ["translate", "--ckpt", tmp_path / "run", "--max-memory", limit, "hello", "--beam"]
    line = assert_one_error_line(*run_cli(capsys, *argv, 4000), r"--beam 4000 needs ~[\d.]+ MB to translate 1 "
                                 r"sentence\(s\) of up to 16 tokens at once, more than the [\d.]+ MB allowed: at most "
                                 r"--beam \d+ fits$")
    most = int(re.search(r"at most --beam (\d+)", line)[1])
    assert 100 <= most < 4000
    # that many pass the check, and the untrained model's missing tokenizer is what stops them
    assert_one_error_line(*run_cli(capsys, *argv, most), r"translate needs a tokenizer")
