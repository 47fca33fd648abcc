"""What a model family is to the rest of the package, and a resolved recipe of one (families/family.py):
a Family checked against its classes when registered, a Run's recipe.yaml, the checkpoint a run
directory holds, what is no model at all, the memory training or evaluating would need, refused
before anything is spent, and the linear layers' kernels a run trains on, kept with it for its resumes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import plainformer as pf
from plainformer import families
from plainformer.checkpoint import format as checkpoint_format
from plainformer.checkpoint.format import load_checkpoint
from plainformer.cli.train import read_config_file
from plainformer.families.family import (
    FINE_TUNING_OPTIONS,
    Family,
    Run,
    check_training_memory,
    checkpoint_dir,
    fit,
    plain,
    refuse_non_model,
    run_and_checkpoint,
)
from plainformer.families.memory_estimates import check_evaluation_memory, held_bytes
from plainformer.memory import MemoryBudgetError, memory_limit
from plainformer.training import kernels
from plainformer.training.config import TrainConfig
from plainformer.training.kernels import KERNELS_FILE
from tests.reference.tiny_models import GPT_TINY


def _run(out: Path, *, model=None, train=None, options=None, overrides=None, fine_tuning=False) -> Run:
    model = model if model is not None or fine_tuning else pf.GPTConfig(**GPT_TINY)
    return Run("gpt-test", families.get("gpt"), model, train or TrainConfig(batch_size=2), options or {}, out,
               None, False, overrides or {}, fine_tuning=fine_tuning)


# ----------------------------------------------------------------------------- a family

@pytest.mark.parametrize("fields, message", [
    (dict(config=pf.GPTConfig, positions="block_size", data_fields=("vocab_sizes",)),
     r"^family 'gpt': vocab_sizes are not fields of GPTConfig$"),
    (dict(config=pf.GPTConfig), r"^family 'gpt': max_len are not fields of GPTConfig$"),  # positions' default
    (dict(config=pf.GPTConfig, positions="block_size", finetune_fields=("dropout", "lr")),
     r"^family 'gpt': lr are not fields of GPTConfig$"),
    (dict(name="gpt2", config=pf.GPTConfig, positions="block_size"),
     r"^family 'gpt2': GPT names family 'gpt' and config GPTConfig$"),
    (dict(config=pf.BertConfig), r"^family 'gpt': GPT names family 'gpt' and config GPTConfig$"),
])
def test_a_family_whose_fields_or_classes_do_not_fit_is_refused_when_registered(fields, message):
    with pytest.raises(ValueError, match=message):
        Family(**{"name": "gpt", "model": pf.GPT, **fields})


def test_plain_values_are_what_yaml_writes_and_reads_back():
    values = {"out": Path("runs/a"), "plays": ("Hamlet", "Macbeth"), "lr": 0.1, "init": None}
    assert plain(values) == {"out": "runs/a", "plays": ["Hamlet", "Macbeth"], "lr": 0.1, "init": None}
    assert yaml.safe_load(yaml.safe_dump(plain(values))) == plain(values)


# ----------------------------------------------------------------------------- a run's recipe.yaml

def test_the_recipe_written_holds_the_model_but_not_what_the_data_decides_and_reads_back_as_flags(tmp_path):
    run = _run(tmp_path / "run", options={"tokenizer": "char", "data": Path("corpus.txt")})
    path = run.write_recipe()
    assert path == tmp_path / "run" / "recipe.yaml"
    assert path.read_text().startswith(f"# plainformer train --config {path} repeats this run")
    written = yaml.safe_load(path.read_text())
    assert written == run.recipe_values() and written["preset"] == "gpt-test" and written["data"] == "corpus.txt"
    assert written["vocab_size"] is None  # the option (a tokenizer's size), not the model's, which the data decides
    assert written["d_model"] == GPT_TINY["d_model"]
    assert not set(FINE_TUNING_OPTIONS) & set(written)  # a run from scratch has no --init
    assert written["batch_size"] == 2 and written["text_field"] is None
    # Every key a flag; a null is a key not given, but an optional field's, which it sets to None as the run had it.
    optional = {field.name for config in (pf.GPTConfig, TrainConfig) for field in dataclasses.fields(config)
                if "None" in str(field.type)}
    assert {"n_kv_heads", "sliding_window", "max_time", "decay_steps"} <= optional
    assert read_config_file(path) == {k: v for k, v in written.items() if v is not None or k in optional}


def test_a_fine_tuning_recipe_holds_only_the_model_fields_given_and_its_init(tmp_path):
    run = _run(tmp_path, options={"init": "runs/base", "lora_r": 4}, overrides={"dropout": 0.1}, fine_tuning=True)
    values = run.recipe_values()
    assert values["init"] == "runs/base" and values["lora_r"] == 4 and values["dropout"] == 0.1
    assert "d_model" not in values and "n_layers" not in values  # the shape is --init's


# ----------------------------------------------------------------------------- run and checkpoint directories

def test_a_run_directory_gives_its_best_checkpoint_else_its_last(tmp_path):
    (tmp_path / "last").mkdir()
    assert checkpoint_dir(tmp_path) == tmp_path / "last"
    (tmp_path / "best").mkdir()
    assert checkpoint_dir(tmp_path) == tmp_path / "best"
    assert run_and_checkpoint(tmp_path) == (tmp_path, tmp_path / "best")
    assert run_and_checkpoint(tmp_path / "last") == (tmp_path, tmp_path / "last")  # a checkpoint inside a run


def test_the_copy_an_interrupted_save_left_is_found_and_said(tmp_path, capsys):
    (tmp_path / ".last.old").mkdir()
    assert checkpoint_dir(tmp_path) == tmp_path / ".last.old"
    assert capsys.readouterr() == ("", f"plainformer: {tmp_path / 'last'} is missing; loading "
                                       f"{tmp_path / '.last.old'}, left by a save that was interrupted\n")


def test_a_directory_without_best_or_last_is_taken_as_the_checkpoint(tmp_path):
    assert checkpoint_dir(tmp_path) == tmp_path and run_and_checkpoint(tmp_path) == (tmp_path.parent, tmp_path)


def test_a_directory_holding_no_model_is_refused_saying_what_it_lacks(tmp_path):
    with pytest.raises(ValueError, match=r"holds neither a plainformer checkpoint or run \(manifest\.json, best/, "
                                         r"last/\) nor a Hugging Face model \(config\.json\)$"):
        refuse_non_model(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match=r"config\.json has no model_type: not a Hugging Face model \(and .* holds "
                                         r"no plainformer checkpoint: manifest\.json is missing\)$"):
        refuse_non_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": ')
    with pytest.raises(ValueError, match=r"config\.json is not a Hugging Face config \(JSON\): "):
        refuse_non_model(tmp_path)


def test_a_checkpoint_a_hugging_face_directory_or_a_path_to_be_found_are_not_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "manifest.json").write_text("{}")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "gpt2"}')
    for path in (tmp_path / "ckpt", tmp_path / "hf", tmp_path / "absent"):
        refuse_non_model(path)


# ----------------------------------------------------------------------------- memory

def test_training_is_refused_before_the_data_naming_the_batch_size_to_blame(tmp_path):
    run = _run(tmp_path, train=TrainConfig(batch_size=10**8))
    with memory_limit(10**9), pytest.raises(MemoryBudgetError, match=(
            r"^batch_size=100000000: training needs ~[\d.]+ [TP]B \(the model, its gradients, AdamW's state and the "
            r"activations of a batch of 100000000 x 24 tokens\), more than the 1\.0 GB allowed$")):
        check_training_memory(run)
    with memory_limit(10**9):
        check_training_memory(_run(tmp_path, train=TrainConfig(batch_size=2, optimizer="muon")))


@pytest.mark.parametrize("tokenizer", ["bpe", "char"])
def test_the_vocabulary_a_tokenizer_is_to_be_trained_to_counts_before_the_data(tokenizer, tmp_path):
    """--vocab-size is the size of a trained tokenizer; a char tokenizer's is the text's characters, which
    the estimate before the data leaves out."""
    run = _run(tmp_path, options={"tokenizer": tokenizer, "vocab_size": 10**7})
    with memory_limit(10**9):
        if tokenizer == "char":
            check_training_memory(run)
        else:
            with pytest.raises(MemoryBudgetError, match=r"^vocab_size=10000000: training needs"):
                check_training_memory(run)
    assert run.model.vocab_size == GPT_TINY["vocab_size"]  # the run's config is left as it was


def test_a_fine_tuning_run_is_checked_once_its_model_is_built(tmp_path):
    model = pf.GPT(pf.GPTConfig(**GPT_TINY))
    with memory_limit(1):
        check_training_memory(_run(tmp_path, fine_tuning=True))  # --init's model: nothing to estimate yet
        with pytest.raises(MemoryBudgetError, match=r"^training needs ~[\d.]+ kB \(the model, its gradients, "):
            check_training_memory(_run(tmp_path, fine_tuning=True), model=model)


def test_evaluation_is_refused_when_a_forward_pass_beside_the_model_would_not_fit():
    model = pf.GPT(pf.GPTConfig(**GPT_TINY))
    with memory_limit(held_bytes(model) + 10**6):
        check_evaluation_memory(model, rows=2)
        with pytest.raises(MemoryBudgetError, match=r"^evaluating 100000 rows at once \(--batch-size\) needs ~[\d.]+ "
                                                    r"[GM]B for the model and a forward pass, more than the "):
            check_evaluation_memory(model, rows=100_000)


# ----------------------------------------------------------------------------- the linear layers' kernels

ONEDNN_FORWARD = {"forward": "onednn", "grad_input": "onednn", "grad_weight": "aten"}
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


class Kernels:
    """The measurement of `training.kernels`, answering ONEDNN_FORWARD: the rows it was asked for
    (`measured`), and the kernels each plain linear layer's forward ran on (`ran`)."""

    def __init__(self, monkeypatch):
        self.measured, self.ran = [], []
        monkeypatch.setattr(kernels, "choose_kernels", lambda model, rows: self.measured.append(rows) or (
            dict(ONEDNN_FORWARD), dict(forward=1.2, grad_input=1.3, grad_weight=0.8)))
        layer_forward = kernels._layer_forward
        monkeypatch.setattr(kernels, "_layer_forward", lambda layer, chosen, x: self.ran.append(chosen)
                            or layer_forward(layer, chosen, x))


def _fit_tiny_gpt(out: Path, max_steps: int, resume: bool = False, seed: int = 0) -> tuple[pf.GPT, dict]:
    """`fit` a tiny GPT for `max_steps` of one schedule (decay over 8 steps), from OUT/last with `resume`
    (the model's initial weights, from `seed`, then replaced by the checkpoint's)."""
    torch.manual_seed(seed)
    model = pf.GPT(pf.GPTConfig(**GPT_TINY))
    tokens = np.random.default_rng(0).integers(0, GPT_TINY["vocab_size"], 1000)
    source = pf.LMBatchSource(tokens[:800], tokens[800:], GPT_TINY["block_size"], seed=3)
    train = TrainConfig(max_steps=max_steps, decay_steps=8, batch_size=2, lr=1e-2, min_lr=1e-3, warmup_steps=2,
                        eval_interval=3, eval_batches=2, log_interval=1, save_interval=0, seed=7, dtype="float32")
    run = Run("gpt-test", families.get("gpt"), model.config, train, {}, out,
              load_checkpoint(out / "last") if resume else None, False, {})
    return model, fit(run, model, source, tokenizer=None)


def _metrics(out: Path, key: str) -> list:
    return [(r["step"], r[key]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in r]


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


@needs_onednn
def test_a_float32_run_trains_on_the_measured_kernels_keeps_them_with_the_run_and_resumes_on_them_bit_exact(
        tmp_path, monkeypatch, capsys):
    chosen = Kernels(monkeypatch)
    whole, _ = _fit_tiny_gpt(tmp_path / "whole", max_steps=8)
    assert chosen.measured == [2 * GPT_TINY["block_size"]]  # a batch's tokens
    assert chosen.ran and all(kernels == ONEDNN_FORWARD for kernels in chosen.ran)  # every product on the choice
    assert not any("forward" in vars(layer) for layer in whole.modules())  # and as before after the run
    assert "linear kernels: forward onednn (1.20x), grad input onednn (1.30x), grad weight aten (0.80x)" \
        in capsys.readouterr().err

    _fit_tiny_gpt(tmp_path / "split", max_steps=4)
    assert json.loads((tmp_path / "split" / KERNELS_FILE).read_text()) == ONEDNN_FORWARD  # kept with the run,
    assert "linear_kernels" not in load_checkpoint(tmp_path / "split" / "last").trainer_state  # not the Trainer's
    chosen.measured.clear()
    chosen.ran.clear()
    resumed, _ = _fit_tiny_gpt(tmp_path / "split", max_steps=8, resume=True, seed=99)
    assert chosen.measured == [] and chosen.ran and all(kernels == ONEDNN_FORWARD for kernels in chosen.ran)
    assert "linear kernels: forward onednn, grad input onednn, grad weight aten (resumed)" in capsys.readouterr().err
    _assert_same_weights(resumed, whole)
    assert _metrics(tmp_path / "split", "train_loss") == _metrics(tmp_path / "whole", "train_loss")


def _as_written_before_the_kernels_file(out: Path) -> None:
    """OUT as a plainformer whose Trainer chose the kernels left it: the choice in last/trainer_state.json
    (the manifest made to match, as that plainformer wrote it), no KERNELS_FILE."""
    kept = json.loads((out / KERNELS_FILE).read_text())
    (out / KERNELS_FILE).unlink()
    state = out / "last" / "trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "linear_kernels": kept}))
    (out / "last" / "manifest.json").unlink()
    checkpoint_format._write_manifest(out / "last")


@needs_onednn
def test_a_checkpoint_that_holds_its_kernels_in_the_trainer_state_resumes_on_them_bit_exact(
        tmp_path, monkeypatch, capsys):
    chosen = Kernels(monkeypatch)
    whole, _ = _fit_tiny_gpt(tmp_path / "whole", max_steps=8)
    _fit_tiny_gpt(tmp_path / "old", max_steps=4)
    _as_written_before_the_kernels_file(tmp_path / "old")
    chosen.measured.clear()
    chosen.ran.clear()
    capsys.readouterr()
    resumed, _ = _fit_tiny_gpt(tmp_path / "old", max_steps=8, resume=True, seed=99)
    assert chosen.measured == [] and chosen.ran and all(kernels == ONEDNN_FORWARD for kernels in chosen.ran)
    assert "linear kernels: forward onednn, grad input onednn, grad weight aten (resumed)" in capsys.readouterr().err
    _assert_same_weights(resumed, whole)
    assert _metrics(tmp_path / "old", "train_loss") == _metrics(tmp_path / "whole", "train_loss")
    assert json.loads((tmp_path / "old" / KERNELS_FILE).read_text()) == ONEDNN_FORWARD  # adopted by the run


@needs_onednn
def test_a_run_begun_before_kernels_were_chosen_resumes_on_aten_without_measuring(tmp_path, monkeypatch):
    chosen = Kernels(monkeypatch)
    _fit_tiny_gpt(tmp_path, max_steps=2)
    (tmp_path / KERNELS_FILE).unlink()  # and its trainer state holds none
    chosen.measured.clear()
    chosen.ran.clear()
    _fit_tiny_gpt(tmp_path, max_steps=3, resume=True)
    assert chosen.measured == [] and chosen.ran == []  # every layer's F.linear, as autograd multiplies
    assert json.loads((tmp_path / KERNELS_FILE).read_text()) == dict.fromkeys(kernels.PRODUCTS, "aten")
