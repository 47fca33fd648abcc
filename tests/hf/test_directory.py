"""A Hugging Face model directory's plain files (hf/directory.py): config.json and the weights, in one
model.safetensors, in the shards an index lists or in pytorch_model.bin, read back against what
transformers itself writes (tiny models built locally, no network); every malformed file one ValueError
naming it."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from safetensors.torch import save_file

from plainformer.hf.bert import load_hf_bert
from plainformer.hf.directory import (
    HF_OPTIONAL_SIZES,
    PYTORCH_BIN,
    SAFETENSORS,
    SHARD_INDEX,
    check_hf_sizes,
    is_hf_directory,
    read_hf_config,
    read_hf_weights,
    read_sharded_hf_weights,
    write_hf_config,
)
from tests.reference.hf_gpt import _hf_config
from tests.reference.torch_reference import assert_close


class NotATensor:
    """What a pickle may hold besides tensors: loading it needs more than weights_only allows."""


def _saved_llama(directory, **save_options) -> dict[str, torch.Tensor]:
    """An untied tiny Llama that transformers saves into `directory`; its state dict."""
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(_hf_config("llama-gqa-untied"))
    theirs.save_pretrained(directory, **save_options)
    return theirs.state_dict()


# ----------------------------------------------------------------------------- weights

def test_shards_that_transformers_wrote_read_back_as_its_tensors(tmp_path):
    theirs = _saved_llama(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / SHARD_INDEX).read_text())["weight_map"]
    assert len(set(index.values())) > 1 and not (tmp_path / SAFETENSORS).exists()
    ours = read_sharded_hf_weights(tmp_path)
    assert ours.keys() == index.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_one_weights_file_and_its_shards_read_back_alike(tmp_path):
    _saved_llama(tmp_path / "one")
    _saved_llama(tmp_path / "shards", max_shard_size="20KB")
    assert not (tmp_path / "one" / SHARD_INDEX).exists()
    one, shards = read_sharded_hf_weights(tmp_path / "one"), read_sharded_hf_weights(tmp_path / "shards")
    assert one.keys() == shards.keys()
    assert all(torch.equal(one[name], shards[name]) for name in one)


def test_pytorch_model_bin_is_read_with_weights_only(tmp_path, monkeypatch):
    hf = transformers.BertModel(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
        max_position_embeddings=12)).eval()
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")  # the format older checkpoints use
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    ours = load_hf_bert(tmp_path)
    assert calls == [True]
    ids = torch.randint(0, 40, (1, 5))
    with torch.no_grad():
        assert_close(ours(ids).last_hidden_state, hf(input_ids=ids).last_hidden_state, "from .bin")


def test_model_safetensors_is_read_before_pytorch_model_bin(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / SAFETENSORS)
    torch.save({"w": torch.zeros(2)}, tmp_path / PYTORCH_BIN)
    assert torch.equal(read_hf_weights(tmp_path)["w"], torch.ones(2))


def test_a_pickle_asking_for_more_than_tensors_is_refused_advising_safetensors(tmp_path):
    torch.save({"w": torch.zeros(2), "extra": NotATensor()}, tmp_path / PYTORCH_BIN)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin is not loadable safely \(its pickle asks for more "
                                         r"than tensors\); convert it to model\.safetensors$"):
        read_hf_weights(tmp_path)


@pytest.mark.parametrize("name, content, message", [
    (SAFETENSORS, b"\x08\x00\x00\x00\x00\x00\x00\x00{}", r"model\.safetensors is not a valid safetensors file"),
    (PYTORCH_BIN, b"PK\x03\x04 truncated", r"pytorch_model\.bin is not a readable PyTorch weights file"),
])
def test_a_malformed_weights_file_is_one_value_error_naming_it(name, content, message, tmp_path):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_hf_weights(tmp_path)


def test_a_pickle_of_something_else_than_a_state_dict_is_refused(tmp_path):
    torch.save([torch.zeros(2)], tmp_path / PYTORCH_BIN)
    with pytest.raises(ValueError, match=r"does not hold a state dict \(names -> tensors\)"):
        read_hf_weights(tmp_path)


def test_integer_weights_are_refused_by_name_but_integer_position_ids_are_kept(tmp_path):
    position_ids = torch.arange(4).view(1, 4)
    save_file({"embeddings.position_ids": position_ids, "w": torch.ones(2)}, tmp_path / SAFETENSORS)
    assert torch.equal(read_hf_weights(tmp_path)["embeddings.position_ids"], position_ids)
    save_file({"embeddings.position_ids": position_ids, "layer.weight": torch.ones(2, dtype=torch.int8)},
              tmp_path / SAFETENSORS)
    with pytest.raises(ValueError, match=r"holds non-floating-point weights: layer\.weight$"):
        read_hf_weights(tmp_path)


def test_a_directory_without_weights_names_both_files_it_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"expected model\.safetensors or pytorch_model\.bin$"):
        read_sharded_hf_weights(tmp_path)


@pytest.mark.parametrize("weight_map, message", [
    (["model-00001-of-00002.safetensors"], r"weight_map must map weight names to shard file names"),
    ({"w": 3}, r"weight_map must map weight names to shard file names"),
    ({"w": "../elsewhere.safetensors"}, r"must map weights to shard files in"),
    ({}, r"must map weights to shard files in"),
])
def test_a_shard_index_that_does_not_list_shard_files_here_is_refused(weight_map, message, tmp_path):
    (tmp_path / SHARD_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=message):
        read_sharded_hf_weights(tmp_path)


# ----------------------------------------------------------------------------- config.json

def test_a_config_json_written_here_is_read_by_transformers_and_back_unchanged(tmp_path):
    hf_config = {"model_type": "llama", "vocab_size": 61, "hidden_size": 32, "num_attention_heads": 4,
                 "num_hidden_layers": 2, "intermediate_size": 64, "rms_norm_eps": 1e-6}
    write_hf_config(tmp_path, hf_config)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(theirs) is transformers.LlamaConfig
    assert all(getattr(theirs, key) == value for key, value in hf_config.items())
    assert read_hf_config(tmp_path) == hf_config and is_hf_directory(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert list(json.loads(text)) == sorted(hf_config) and text.endswith("}\n")


def test_the_config_json_transformers_writes_is_read_as_written(tmp_path):
    _hf_config("gpt2").save_pretrained(tmp_path)
    assert read_hf_config(tmp_path) == json.loads((tmp_path / "config.json").read_text())
    assert read_hf_config(tmp_path)["model_type"] == "gpt2"


@pytest.mark.parametrize("config_json", [None, '{"hidden_size": 8}', '{"model_type": ', '["model_type"]', "a folder",
                                         "no directory"])
def test_only_a_config_json_naming_a_model_type_makes_a_hugging_face_directory(config_json, tmp_path):
    directory = tmp_path / "absent" if config_json == "no directory" else tmp_path
    if config_json == "a folder":
        (tmp_path / "config.json").mkdir()
    elif config_json is not None and directory.exists():
        (tmp_path / "config.json").write_text(config_json)
    assert not is_hf_directory(directory)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "bert"}')
    assert is_hf_directory(tmp_path / "other")  # the same, naming a model_type


def test_a_missing_config_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a Hugging Face model directory: config\.json is missing"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("config", [transformers.GPT2Config(), transformers.BertConfig(),
                                    transformers.LlamaConfig(num_key_value_heads=8)], ids=["gpt2", "bert", "llama"])
def test_the_sizes_transformers_writes_pass_the_check(config):
    check_hf_sizes(config.to_dict())


@pytest.mark.parametrize("key, value", [
    ("n_layer", 0), ("hidden_size", -1), ("num_attention_heads", True), ("vocab_size", 2.5), ("n_embd", "768"),
    ("max_position_embeddings", None), ("head_dim", 0), ("num_key_value_heads", 1.0),
])
def test_a_size_that_is_no_positive_integer_is_named_in_hugging_faces_words(key, value):
    with pytest.raises(ValueError, match=rf"^config\.json: {key} must be a positive integer, got {value!r}$"):
        check_hf_sizes({"vocab_size": 10, key: value})


def test_only_the_optional_sizes_may_be_null():
    check_hf_sizes(dict.fromkeys(HF_OPTIONAL_SIZES))
    assert set(HF_OPTIONAL_SIZES) == {"n_inner", "head_dim", "num_key_value_heads"}
