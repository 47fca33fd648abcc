"""What every model family's class shares (models/family_model.py): the constructor's opening (the config's
type, then the model's bytes against the memory available, before anything is allocated), the classes
found by family, and checkpoints checked before a model is built from them."""

from __future__ import annotations

import pytest
import torch

import plainformer as pf
from plainformer.checkpoint.format import CheckpointError, load_checkpoint
from plainformer.families import memory_estimates as memory
from plainformer.models import family_model
from plainformer.models.family_model import FamilyModel, check_stored_parameters, model_class
from tests.reference.tiny_models import BERT_TINY, GPT_TINY, SEQ2SEQ_TINY

CLASSES = [pf.GPT, pf.BertModel, pf.BertForMaskedLM, pf.BertForSequenceClassification, pf.Transformer]


# ----------------------------------------------------------------------------- the constructor's opening

@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_a_config_of_another_type_is_refused_naming_the_class_expected_before_the_memory_check(cls):
    wrong = pf.TransformerConfig(**SEQ2SEQ_TINY) if cls is not pf.Transformer else pf.GPTConfig(**GPT_TINY)
    with memory.memory_limit(1), pytest.raises(
            TypeError, match=rf"^config must be a {cls.config_class.__name__}, got {type(wrong).__name__}$"):
        cls(wrong)


def test_a_new_model_keeps_its_config_and_has_no_tokenizer_yet():
    config = pf.BertConfig(**BERT_TINY)
    model = pf.BertForSequenceClassification(config)
    assert model.config is config and model.tokenizer is None


def test_a_model_too_big_for_the_memory_is_refused_naming_the_field_before_it_is_built():
    tiny = dict(vocab_size=50, block_size=8, n_layers=1, n_heads=2, d_model=16, d_ff=32, pos_encoding="rope")
    limit = 2 * memory.model_bytes(pf.GPTConfig(**tiny))
    for field, value in (("n_layers", 12), ("vocab_size", 5000), ("d_ff", 2000), ("d_model", 512),
                         ("block_size", 10**4)):
        config = pf.GPTConfig(**{**tiny, field: value})
        message = rf"^{field}={value}: the model needs ~[\d.]+ [kM]B for its parameters and buffers, more than the "
        with memory.memory_limit(limit), pytest.raises(memory.MemoryBudgetError, match=message + r".* kB allowed$"):
            pf.GPT(config)
    with memory.memory_limit(memory.model_bytes(pf.BertConfig(**BERT_TINY), family="bert")):
        pf.BertModel(pf.BertConfig(**BERT_TINY))  # exactly enough
        with pytest.raises(ValueError, match=r"^n_labels=3000: the model needs"):
            pf.BertForSequenceClassification(pf.BertConfig(**{**BERT_TINY, "n_labels": 3000}))
        with pytest.raises(ValueError, match=r"^the model needs"):  # the MLM head is more; no size is large
            pf.BertForMaskedLM(pf.BertConfig(**BERT_TINY))
    with memory.memory_limit(memory.model_bytes(pf.TransformerConfig(**SEQ2SEQ_TINY))):
        with pytest.raises(ValueError, match=r"^n_encoder_layers=3: the model needs"):
            pf.Transformer(pf.TransformerConfig(**SEQ2SEQ_TINY, n_encoder_layers=3))


def test_nothing_is_refused_on_the_meta_device():
    with memory.memory_limit(1), torch.device("meta"):
        assert pf.GPT(pf.GPTConfig(**GPT_TINY)).token_embedding.weight.is_meta


# ----------------------------------------------------------------------------- the classes, by family

def test_a_class_is_found_by_its_family_or_by_its_configs_type():
    bert = pf.BertConfig(**BERT_TINY)
    assert model_class(bert) is pf.BertModel and model_class(bert, "bert-mlm") is pf.BertForMaskedLM
    assert model_class(pf.GPTConfig(**GPT_TINY)) is pf.GPT
    assert model_class(pf.TransformerConfig(**SEQ2SEQ_TINY)) is pf.Transformer
    with pytest.raises(ValueError, match=r"^family must be one of bert, bert-mlm, bert-cls, gpt, transformer for a "
                                         r"GPTConfig, got 'llama'$"):
        model_class(pf.GPTConfig(**GPT_TINY), "llama")


def test_a_new_class_naming_a_family_is_found_by_it_and_the_first_of_a_name_stays(monkeypatch):
    monkeypatch.setattr(family_model, "_CLASSES", dict(family_model._CLASSES))  # the registry, restored after the test

    class Toy(FamilyModel):
        family = "toy"
        config_class = pf.GPTConfig

    class ToyAgain(Toy):
        family = "toy"

    config = pf.GPTConfig(**GPT_TINY)
    assert model_class(config, "toy") is Toy
    assert model_class(config) is pf.GPT  # the first class of a GPTConfig



def test_the_old_name_saved_model_is_the_same_class():
    assert family_model.SavedModel is FamilyModel
    assert all(issubclass(cls, family_model.SavedModel) for cls in CLASSES)

# ----------------------------------------------------------------------------- from a checkpoint

@pytest.fixture
def gpt_checkpoint(tmp_path):
    model = pf.GPT(pf.GPTConfig(**GPT_TINY))
    return pf.save_checkpoint(tmp_path / "ckpt", model=model, family="gpt", model_config=model.config.to_dict())


def test_a_checkpoint_of_another_family_is_refused_naming_both(gpt_checkpoint):
    with pytest.raises(CheckpointError, match=r"holds a 'gpt' model, not a BertModel \('bert'\)$"):
        pf.BertModel.from_checkpoint(gpt_checkpoint)


def test_a_config_describing_more_parameters_than_the_weights_hold_is_refused_before_building(gpt_checkpoint):
    checkpoint = load_checkpoint(gpt_checkpoint)
    check_stored_parameters(checkpoint, pf.GPTConfig(**GPT_TINY))  # as saved: nothing to say
    stored = sum(p.numel() for p in pf.GPT(pf.GPTConfig(**GPT_TINY)).parameters())
    with pytest.raises(CheckpointError, match=rf"config\.json describes a model of [\d,]+ parameters but .*model\."
                                              rf"safetensors holds {stored:,} values: they do not belong together$"):
        check_stored_parameters(checkpoint, pf.GPTConfig(**{**GPT_TINY, "n_layers": 100_000}))
