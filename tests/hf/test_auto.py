"""`save_hf` and `load_hf` over the families (hf/auto.py): a directory goes to the family of its
config.json's model_type, a model to the module of its class, and the tokenizer travels beside the
weights whatever the family; directories built locally with transformers (tiny configs, no network)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

import plainformer as pf
from tests.reference.hf_gpt import (
    LLAMA,
    TINY,
    TOLERANCE,
    _gpt2_tokenizer_files,
    _hf_directory,
    _max_error,
    _ours,
)

BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "##s", "a", "."]


def _bert_directory(tmp_path):
    """A tiny BERT that transformers saves, with BERT's original vocab.txt as its only tokenizer file."""
    torch.manual_seed(0)
    theirs = transformers.BertModel(transformers.BertConfig(
        vocab_size=len(BERT_VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=20)).eval()
    directory = tmp_path / "bert"
    theirs.save_pretrained(directory)
    (directory / "vocab.txt").write_text("\n".join(BERT_VOCAB) + "\n")
    return theirs, directory


# ----------------------------------------------------------------------------- a directory, by its model_type

@pytest.mark.parametrize("name, positions", [("gpt2", "learned"), ("llama-gqa-untied", "rope")])
def test_a_gpt2_or_llama_directory_transformers_wrote_loads_as_a_gpt_of_its_layout(name, positions, tmp_path):
    _, directory = _hf_directory(name, tmp_path)
    model = pf.load_hf(directory)
    assert type(model) is pf.GPT and model.family == "gpt" and not model.training
    assert model.config.pos_encoding == positions
    assert model.tokenizer is None  # transformers wrote no tokenizer file


def test_a_bert_directory_transformers_wrote_loads_as_a_bert_model_with_its_vocab_txt(tmp_path):
    theirs, directory = _bert_directory(tmp_path)
    model = pf.load_hf(directory)
    assert type(model) is pf.BertModel and model.family == "bert" and not model.training
    text = "the cats sat on a mat."
    ids = transformers.BertTokenizer(str(directory / "vocab.txt"))(text)["input_ids"]
    assert model.tokenizer.encode(text) == ids
    idx = torch.tensor([ids])
    with torch.no_grad():
        assert _max_error(model(idx).last_hidden_state, theirs(idx).last_hidden_state) <= TOLERANCE


def test_a_directory_without_config_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a Hugging Face model directory: config\.json is missing"):
        pf.load_hf(tmp_path)


def test_a_plainformer_checkpoint_is_not_taken_for_a_hugging_face_directory(tmp_path):
    model = _ours("gpt2")
    pf.save_checkpoint(tmp_path, model=model, family="gpt", model_config=model.config.to_dict())
    with pytest.raises(ValueError, match="no model_type: not a Hugging Face model directory"):
        pf.load_hf(tmp_path)


# ----------------------------------------------------------------------------- a model, by its class

def test_bert_saves_and_loads_through_the_same_entry_points(tmp_path):
    torch.manual_seed(0)
    bert = pf.BertModel(pf.BertConfig(vocab_size=40, max_len=16, n_layers=2, n_heads=2, d_model=16,
                                      d_ff=32)).eval()
    pf.save_hf(bert, tmp_path)
    back = pf.load_hf(tmp_path)
    assert isinstance(back, pf.BertModel)
    for key, value in back.state_dict().items():
        assert torch.equal(value, bert.state_dict()[key]), key
    theirs = transformers.AutoModel.from_pretrained(tmp_path).eval()
    idx = torch.randint(1, 40, (2, 10), generator=torch.Generator().manual_seed(0))  # no [PAD] (id 0)
    with torch.no_grad():
        assert _max_error(bert(idx).last_hidden_state, theirs(idx).last_hidden_state) <= TOLERANCE


def test_save_refuses_other_models(tmp_path):
    with pytest.raises(TypeError, match="model must be a GPT, a BertModel, a BertForSequenceClassification or a "
                                        "Transformer, got Linear"):
        pf.save_hf(torch.nn.Linear(2, 2), tmp_path)


# ----------------------------------------------------------------------------- the tokenizer, beside the weights

def test_save_hf_writes_the_models_tokenizer(tokenizers, tmp_path):
    model = pf.GPT(pf.GPTConfig(**{**TINY, "vocab_size": tokenizers["bpe"].vocab_size}, **LLAMA))
    model.tokenizer = tokenizers["bpe"]
    pf.save_hf(model, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs.eos_token_id == model.tokenizer.eos_id
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == model.tokenizer.eos_id
    assert pf.load_hf(tmp_path).tokenizer.fingerprint == model.tokenizer.fingerprint


def test_load_hf_of_a_gpt2_directory_with_only_vocab_and_merges_has_its_tokenizer(gpt2_bpe, corpus_lines,
                                                                                 tmp_path):
    _, directory = _hf_directory("gpt2", tmp_path)
    _gpt2_tokenizer_files(gpt2_bpe, directory)  # config.json's model_type tells AutoTokenizer the class
    assert not (directory / "tokenizer.json").exists() and not (directory / "tokenizer_config.json").exists()
    expected = transformers.AutoTokenizer.from_pretrained(directory)(corpus_lines)["input_ids"]
    model = pf.load_hf(directory)
    assert model.tokenizer.kind == "bpe" and model.tokenizer.encode_many(corpus_lines) == expected


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_a_tokenizer_given_to_save_hf_wins_over_the_models_and_takes_its_context(family, tmp_path):
    model = (pf.GPT(pf.GPTConfig(**TINY, **LLAMA)) if family == "gpt" else
             pf.BertModel(pf.BertConfig(vocab_size=61, max_len=24, n_layers=1, n_heads=2, d_model=8, d_ff=16)))
    model.tokenizer = pf.CharTokenizer("abcdefgh")
    given = pf.CharTokenizer("ijklmnopqrstu")
    pf.save_hf(model, tmp_path, tokenizer=given)
    assert pf.load_hf(tmp_path).tokenizer.fingerprint == given.fingerprint
    context = model.config.block_size if family == "gpt" else model.config.max_len
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).model_max_length == context
