"""A Hugging Face model directory, whatever the model: its config.json and its weights.

Nothing is copied from `transformers`: a Hugging Face model directory is plain files (config.json,
model.safetensors, the shards a model.safetensors.index.json lists, or pytorch_model.bin, and tokenizer
files), read here and mapped onto plainformer's modules name by name by each family's module (`hf.gpt`,
`hf.bert`). `pytorch_model.bin` is read with `torch.load(weights_only=True)`, never unpickled in full; a
file that needs more than that is refused, with the advice to convert it to safetensors. Every file is
data from outside: malformed JSON, weights or dtypes give one ValueError naming the file.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from .. import _checks
from ..files.atomic import atomic_path
from ..files.json_file import read_json_object

SAFETENSORS = "model.safetensors"
PYTORCH_BIN = "pytorch_model.bin"
HF_CONFIG = "config.json"
SHARD_INDEX = "model.safetensors.index.json"

# Integer buffers some checkpoints (BERT's) carry beside the (floating-point) weights.
_INTEGER_BUFFERS = ("position_ids", "token_type_ids")

#: The keys of a Hugging Face config.json that are sizes, in the layouts read here (BERT, GPT-2, Llama),
#: and those of them that may be null (the layout then derives them).
HF_SIZES = ("vocab_size", "type_vocab_size", "max_position_embeddings", "n_positions", "hidden_size", "n_embd",
            "num_hidden_layers", "n_layer", "num_attention_heads", "n_head", "intermediate_size")
HF_OPTIONAL_SIZES = ("n_inner", "head_dim", "num_key_value_heads")


def check_hf_sizes(hf: Mapping[str, Any]) -> None:
    """Each size in a Hugging Face config.json is a positive integer (or null where it may be), checked
    before any arithmetic on it, so that a bad one is named in Hugging Face's words."""
    for key in (*HF_SIZES, *HF_OPTIONAL_SIZES):
        value = hf.get(key)
        allowed = _checks.is_int(value) and value > 0 or value is None and key in HF_OPTIONAL_SIZES
        if key in hf and not allowed:
            raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / HF_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a Hugging Face model directory: {HF_CONFIG} is missing")
    return read_json_object(path)


def is_hf_directory(directory: str | os.PathLike) -> bool:
    """Whether `directory` looks like a Hugging Face model directory (config.json with a model_type)."""
    path = Path(directory) / HF_CONFIG
    try:
        return path.is_file() and "model_type" in read_json_object(path)
    except (OSError, ValueError):
        return False


def write_hf_config(directory: Path, hf_config: Mapping[str, Any]) -> None:
    """config.json, keys sorted, written to a temporary name and renamed into place."""
    with atomic_path(directory / HF_CONFIG) as tmp:
        tmp.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def read_hf_weights(directory: str | os.PathLike) -> dict[str, Tensor]:
    """The floating-point tensors of model.safetensors, else of pytorch_model.bin (loaded with
    weights_only=True); ValueError for anything else."""
    directory = Path(directory)
    if (directory / SAFETENSORS).is_file():
        path = directory / SAFETENSORS
        try:
            state = load_file(path)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a valid safetensors file: {e}") from None
    elif (directory / PYTORCH_BIN).is_file():
        path = directory / PYTORCH_BIN
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            # torch's message would suggest weights_only=False, i.e. running the file's code.
            raise ValueError(f"{path} is not loadable safely (its pickle asks for more than tensors); "
                             f"convert it to {SAFETENSORS}") from None
        except (RuntimeError, EOFError, ValueError) as e:
            raise ValueError(f"{path} is not a readable PyTorch weights file: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    else:
        raise FileNotFoundError(f"no weights in {directory}: expected {SAFETENSORS} or {PYTORCH_BIN}")
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{path} does not hold a state dict (names -> tensors)")
    ints = sorted(k for k, v in state.items()
                  if not v.is_floating_point() and not k.endswith(_INTEGER_BUFFERS))
    if ints:
        raise ValueError(f"{path} holds non-floating-point weights: {', '.join(ints[:5])}")
    return state


def read_sharded_hf_weights(directory: Path) -> dict[str, Tensor]:
    """The tensors of model.safetensors, of the shards its index lists, or of pytorch_model.bin."""
    index = directory / SHARD_INDEX
    if (directory / SAFETENSORS).is_file() or not index.is_file():
        return read_hf_weights(directory)
    mapping = read_json_object(index).get("weight_map", {})
    if not isinstance(mapping, dict) or not all(isinstance(shard, str) for shard in mapping.values()):
        raise ValueError(f"{index}: weight_map must map weight names to shard file names, got {mapping!r:.100}")
    shards = sorted(set(mapping.values()))
    if not shards or any(Path(shard).name != shard for shard in shards):
        raise ValueError(f"{index} must map weights to shard files in {directory}")
    return {name: tensor for shard in shards for name, tensor in load_file(directory / shard).items()}
