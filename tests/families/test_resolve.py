"""A recipe resolved for one run from plain values (families/resolve.py): the values given split into the
model config, the TrainConfig and the options over the recipe's own; what does not apply to the recipe's
family refused naming the families it applies to; a resumed run checked against the one saved. The same
resolution from the command line's flags is tested in tests/cli/test_train.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import plainformer as pf
from plainformer import families, recipes
from plainformer.errors import UserError
from plainformer.families import resolve
from plainformer.families.resolve import (
    check_data_paths,
    data_fields,
    model_configs,
    model_fields,
    model_fields_taken,
    option_families,
    options_taken,
    refuse_changes,
    resolve_run,
)
from plainformer.training.config import TrainConfig

FINE_TUNING = ("gpt-finetune", "bert-finetune")


@pytest.fixture(autouse=True)
def no_probe(monkeypatch):
    """No recipe here is shaped by the machine: a probe of the matmul rate would be a mistake."""
    def matmul_rate(dtype, seconds):
        raise AssertionError("the matmul rate was measured")

    monkeypatch.setattr(resolve, "matmul_rate", matmul_rate)


def _resolve(preset: str, given: dict, out: Path, *, resume: bool = False, saved: dict | None = None):
    recipe = recipes.get(preset)
    return resolve_run(given, preset=preset, recipe=recipe, family=families.get(recipe.family), out=out,
                       resume=resume, saved=saved or {}, progress=False, fine_tuning_recipes=FINE_TUNING)


# ----------------------------------------------------------------------------- what each family takes

def test_the_trained_families_configs_each_once_with_the_fields_their_data_decides():
    assert model_configs() == (pf.GPTConfig, pf.BertConfig, pf.TransformerConfig)
    assert data_fields(pf.GPTConfig) == {"vocab_size"}
    assert data_fields(pf.BertConfig) == {"vocab_size", "pad_id", "n_labels", "label_names"}  # bert-mlm's, bert-cls's
    assert data_fields(pf.TransformerConfig) == {"src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id",
                                                 "source_eos"}


def test_a_model_field_is_owned_by_the_configs_that_have_it_unless_the_data_decides_it():
    owners = model_fields()
    assert owners["d_model"] == [pf.GPTConfig, pf.BertConfig, pf.TransformerConfig]
    assert owners["n_kv_heads"] == [pf.GPTConfig, pf.TransformerConfig]
    assert owners["block_size"] == [pf.GPTConfig]
    assert owners["attention_dropout"] == [pf.BertConfig, pf.TransformerConfig]
    assert not {"vocab_size", "n_labels", "src_vocab_size", "pad_id"} & set(owners)


@pytest.mark.parametrize("option, owners", [("task", ("transformer",)), ("plays", ("bert-cls",)),
                                            ("seq_len", ("bert-mlm", "bert-cls")),
                                            ("threads", ("gpt", "bert-mlm", "bert-cls", "transformer"))])
def test_an_option_belongs_to_the_families_that_declare_it(option, owners):
    assert option_families(option) == owners


def test_a_recipe_takes_its_familys_options_and_fields_and_a_fine_tuning_one_only_what_a_fine_tune_may_change():
    gpt, transformer = families.get("gpt"), families.get("transformer")
    assert options_taken(gpt, False) == ("data", "val_data", "text_field", "tokenizer", "vocab_size", "threads")
    assert options_taken(gpt, True) == ("data", "val_data", "text_field", "threads", "init", "lora_r", "lora_alpha",
                                        "lora_dropout", "lora_targets")
    assert model_fields_taken(gpt, True) == ("dropout",)
    assert "block_size" in model_fields_taken(gpt, False) and "vocab_size" not in model_fields_taken(gpt, False)
    fields = model_fields_taken(transformer, False)
    assert "n_encoder_layers" in fields and not {"src_vocab_size", "pad_id", "source_eos"} & set(fields)


# ----------------------------------------------------------------------------- a fresh run

def test_the_values_given_split_into_model_training_and_options_over_the_recipes(tmp_path):
    recipe = recipes.get("nanogpt-cpu")
    run = _resolve("nanogpt-cpu", {"n_layers": 2, "lr": 0.01, "data": "x.txt", "threads": 3}, tmp_path)
    assert (run.preset, run.family_name, run.out, run.checkpoint) == ("nanogpt-cpu", "gpt", tmp_path, None)
    assert run.model == recipe.model.replace(n_layers=2) and run.model_overrides == {"n_layers": 2}
    assert run.train_config == recipe.train.replace(lr=0.01)
    assert run.options == {**recipe.options, "data": "x.txt", "threads": 3}
    assert not run.fine_tuning and run.shape_note is None


def test_a_field_given_as_none_is_none_over_the_recipes_value(tmp_path):
    assert recipes.get("multi30k-de-en").model.attention_dropout == 0.0
    assert _resolve("multi30k-de-en", {"attention_dropout": None}, tmp_path).model.attention_dropout is None
    assert _resolve("multi30k-de-en", {"max_time": None}, tmp_path).train_config.max_time is None


def test_nothing_given_is_the_recipe_itself(tmp_path):
    recipe = recipes.get("seq2seq-copy")
    run = _resolve("seq2seq-copy", {}, tmp_path)
    assert (run.model, run.train_config, run.options) == (recipe.model, recipe.train, dict(recipe.options))


def test_the_inverse_sqrt_schedule_takes_the_models_width_unless_given(tmp_path):
    assert _resolve("seq2seq-numbers-en-fr", {"d_model": 64}, tmp_path).train_config.schedule_d_model == 64
    given = _resolve("seq2seq-numbers-en-fr", {"d_model": 64, "schedule_d_model": 32}, tmp_path)
    assert given.train_config.schedule_d_model == 32


def test_a_fine_tuning_run_leaves_the_model_to_init_with_the_fields_given(tmp_path):
    run = _resolve("gpt-finetune", {"init": "runs/base", "dropout": 0.1, "lora_r": 4}, tmp_path)
    assert run.fine_tuning and run.model is None and run.model_overrides == {"dropout": 0.1}
    assert run.options["init"] == "runs/base" and run.options["lora_r"] == 4


@pytest.mark.parametrize("preset, given, message", [
    ("nanogpt-cpu", {"task": "copy"}, r"^--task applies to transformer recipes, not to 'nanogpt-cpu' \(gpt\)$"),
    ("seq2seq-copy", {"tokenizer": "char"}, r"^--tokenizer applies to gpt recipes, not to 'seq2seq-copy'"),
    ("nanogpt-cpu", {"lora_r": 4}, r"^--lora-r applies to the fine-tuning recipes \(gpt-finetune, bert-finetune\), "
                                   r"not to 'nanogpt-cpu', which trains from scratch$"),
    ("nanogpt-cpu", {"n_encoder_layers": 2}, r"^--n-encoder-layers is not a field of GPTConfig, the model of "
                                             r"'nanogpt-cpu'$"),
    ("gpt-finetune", {}, r"^preset 'gpt-finetune' fine-tunes the model of --init MODEL: give it$"),
    ("gpt-finetune", {"init": "x", "tokenizer": "bpe"}, r"^--tokenizer does not apply to fine-tuning "
                                                        r"\('gpt-finetune'\): the tokenizer is --init's$"),
    ("gpt-finetune", {"init": "x", "n_layers": 2, "dropout": 0.1}, r"^fine-tuning keeps the shape of --init; of the "
                                                                   r"model fields only dropout may be given, got "
                                                                   r"dropout, n_layers$"),
])
def test_a_value_that_does_not_apply_to_the_recipe_is_refused_saying_where_it_applies(preset, given, message,
                                                                                      tmp_path):
    with pytest.raises(UserError, match=message):
        _resolve(preset, given, tmp_path)


@pytest.mark.parametrize("encoding", ["alibi", "learned", "sinusoidal"])
def test_a_rope_base_given_with_an_encoding_that_never_reads_it_is_refused_by_name(encoding, tmp_path):
    with pytest.raises(UserError, match=rf"^--rope-base is read by --pos-encoding rope only, not by this run's "
                                        rf"--pos-encoding {encoding}: drop it$"):
        _resolve("nanogpt-cpu", {"pos_encoding": encoding, "rope_base": 500.0}, tmp_path)
    assert _resolve("nanogpt-cpu", {"pos_encoding": encoding}, tmp_path).model.pos_encoding == encoding
    assert _resolve("nanogpt-cpu", {"pos_encoding": encoding, "rope_base": 10000.0}, tmp_path)  # a recipe.yaml's
    assert _resolve("nanogpt-cpu", {"pos_encoding": "rope", "rope_base": 500.0}, tmp_path).model.rope_base == 500.0


def test_a_data_option_given_as_blank_text_is_refused_naming_the_flag():
    check_data_paths({"data": "x.txt", "val_data": None})
    with pytest.raises(UserError, match=r"^--val-data must name a file, folder or glob, got ' '$"):
        check_data_paths({"data": "x.txt", "val_data": " "})


# ----------------------------------------------------------------------------- a resumed run

def test_a_saved_value_given_again_as_yaml_would_read_it_is_no_change():
    saved = {"out": "runs/a", "plays": ["Hamlet"], "d_model": 32}
    refuse_changes("run's data", saved, {"out": Path("runs/a"), "plays": ("Hamlet",), "d_model": 32, "new": 1})
    with pytest.raises(UserError, match=r"^--resume continues the saved model, whose d_model, plays differ from the "
                                        r"values given; drop those options$"):
        refuse_changes("model", saved, {"plays": ("Macbeth",), "d_model": 64})


@pytest.fixture
def saved_run(tmp_path):
    """OUT/last of a nanogpt-cpu run of 2 layers, its recipe.yaml's data option x.txt."""
    config = recipes.get("nanogpt-cpu").model.replace(n_layers=2, vocab_size=20)
    model = pf.GPT(config)
    pf.save_checkpoint(tmp_path / "last", model=model, family="gpt", model_config=config.to_dict(),
                       train_config=TrainConfig(max_steps=5).to_dict())
    return tmp_path, {"preset": "nanogpt-cpu", "data": "x.txt", "tokenizer": "char", "n_layers": 2}


def test_a_resumed_run_continues_the_saved_model_with_the_training_options_given(saved_run):
    out, saved = saved_run
    run = _resolve("nanogpt-cpu", {"max_steps": 9, "threads": 2}, out, resume=True, saved=saved)
    assert run.resume and run.checkpoint.path == out / "last"
    assert run.model == recipes.get("nanogpt-cpu").model.replace(n_layers=2, vocab_size=20)
    assert run.train_config == TrainConfig(max_steps=9)  # the saved TrainConfig, not the recipe's
    assert run.options == {"tokenizer": "char", "data": "x.txt", "threads": 2}


@pytest.mark.parametrize("given, message", [
    ({"n_layers": 3}, r"^--resume continues the saved model, whose n_layers differ"),
    ({"data": "y.txt"}, r"^--resume continues the saved run's data, whose data differ"),
])
def test_a_resumed_run_refuses_another_model_or_other_data(given, message, saved_run):
    out, saved = saved_run
    with pytest.raises(UserError, match=message):
        _resolve("nanogpt-cpu", given, out, resume=True, saved=saved)
    _resolve("nanogpt-cpu", {"n_layers": 2, "data": "x.txt"}, out, resume=True, saved=saved)  # the same: no change


def test_a_run_of_another_family_is_not_resumed(saved_run):
    out, _ = saved_run
    with pytest.raises(UserError, match=rf"^{out} holds a gpt run, not one of preset 'seq2seq-copy' \(transformer\)$"):
        _resolve("seq2seq-copy", {}, out, resume=True)
