"""The recipe registry: every family's recipes in one place, each one valid, named once."""

from __future__ import annotations

import dataclasses

import pytest

import plainformer as pf
from plainformer import families, recipes


@pytest.mark.parametrize("name", recipes.names())
def test_every_recipe_has_its_familys_model_config_and_a_valid_training_recipe(name):
    recipe = recipes.get(name)
    family = families.get(recipe.family)
    assert recipe.name == name and family.train is not None
    if recipe.model is None:  # fine-tuning: the model comes from the `init` option
        assert family.finetune_fields and family.from_base is not None and "init" in family.options
    else:
        assert type(recipe.model) is family.config
    assert isinstance(recipe.train, pf.TrainConfig) and recipe.summary
    pf.TrainConfig.from_dict(recipe.train.to_dict())  # validates again


def test_every_gpt_preset_has_a_recipe_with_that_model():
    for name in pf.GPTConfig.preset_names():
        assert recipes.get(name).model == pf.GPTConfig.from_preset(name)
    assert recipes.names("gpt") == ["default", "moe", "nanogpt-cpu", "shakespeare-char", "gpt2", "gpt-finetune"]


def test_gpt2_has_its_own_recipe_not_the_defaults():
    default, gpt2 = pf.TrainConfig(), recipes.get("gpt2").train
    changed = {f.name for f in dataclasses.fields(default) if getattr(default, f.name) != getattr(gpt2, f.name)}
    assert {"lr", "max_steps", "grad_accum_steps", "beta2"} <= changed
    assert recipes.get("gpt2").options == {"tokenizer": "bpe", "vocab_size": 50257}


def test_the_paper_recipe_keeps_the_papers_optimizer():
    paper = pf.TrainConfig.from_preset("transformer-paper")
    numbers = recipes.get("seq2seq-numbers-en-fr")
    for name in ("schedule", "lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip"):
        assert getattr(numbers.train, name) == getattr(paper, name)
    assert numbers.train.schedule_d_model == numbers.model.d_model


def test_unknown_name_lists_the_names():
    with pytest.raises(ValueError, match="unknown preset 'gpt-5'; choose one of default, moe, nanogpt-cpu, "):
        recipes.get("gpt-5")
