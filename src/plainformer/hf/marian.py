"""Marian directories in and out: `save_marian(model, directory)` writes a translation `Transformer` as the
directory that transformers' MarianMTModel and MarianTokenizer load and CTranslate2's
`ct2-transformers-converter` converts; `load_marian(directory)` reads one, Helsinki-NLP's opus-mt models
among them, as a `Transformer` with its tokenizer.

Marian's Transformer is the paper's post-LN encoder-decoder, module for module ({stack}: encoder or decoder):

    Hugging Face (MarianMTModel)                              plainformer Transformer
    model.shared (model.{stack}.embed_tokens, not shared)     encoder.embedding (decoder.embedding)
    model.{stack}.layers.{i}.self_attn.{q,k,v,out}_proj       {stack}.layers.{i}.self_attn.W_{q,k,v,o}
    model.{stack}.layers.{i}.self_attn_layer_norm             {stack}.layers.{i}.norm1
    model.decoder.layers.{i}.encoder_attn.{q,k,v,out}_proj    decoder.layers.{i}.cross_attn.W_{q,k,v,o}
    model.decoder.layers.{i}.encoder_attn_layer_norm          decoder.layers.{i}.norm2
    model.{stack}.layers.{i}.fc1, fc2                         {stack}.layers.{i}.ff.W_1, W_2
    model.{stack}.layers.{i}.final_layer_norm                 encoder: norm2, decoder: norm3
    lm_head (the decoder's embedding unless untied)           output
    final_logits_bias (1, V)                                  output.bias (output_bias)

Three things are mapped rather than renamed:

- The features. The paper interleaves sine and cosine, PE(pos, 2i) = sin(pos·ω_i), PE(pos, 2i+1) = cos(pos·ω_i);
  Marian writes the d/2 sines first, then the cosines. So Marian's feature k is our feature perm[k], perm =
  (0, 2, ..., d-2, 1, 3, ..., d-1). Permuting every tensor indexed by a feature of the residual stream (the
  embeddings' columns, the LayerNorms' γ and β, the input columns of the matrices that read the stream, the
  output rows and biases of those that write it) gives the same network in Marian's coordinates: attention
  and the feed-forward's hidden layer keep their own, and LayerNorm's mean and variance ignore the order.
- The vocabulary. Marian's <pad> is its last id (CTranslate2's converter drops that row as Marian's pad);
  ours moves there, the other ids keeping their order.
- The decoder's start. Marian and CTranslate2 start the decoder from a zero vector, transformers from the
  embedding of decoder_start_token_id (<pad>, zero in opus-mt's models); ours starts from E[bos]. The export
  zeroes pad's row, makes it the start, and adds √d_model·E[bos] to row 0 of the decoder's position table,
  which it stores (model.decoder.embed_positions.weight): position 0 only ever holds the start token. What
  changes is pad's logit, the bias alone; generation_config.json bans pad, as opus-mt's does, and
  CTranslate2 has no pad. Reading a directory, a start folded so into row 0 is found again as the token
  whose embedding it is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from .. import _checks
from ..data.tokenizers import MarianTokenizer, SentencePieceTokenizer, Tokenizer
from ..files.atomic import atomic_path, reporting_full_disk, write_files
from ..models.transformer import Transformer, TransformerConfig
from ..nn.positional import sinusoidal_table
from .directory import SAFETENSORS, read_hf_config, read_sharded_hf_weights, write_hf_config

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
# Our activation -> Marian's activation_function (transformers' ACT2FN names, which CTranslate2 also reads).
MARIAN_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "silu": "swish"}
_FROM_MARIAN_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                            "swish": "silu", "silu": "silu"}
_SIZES = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
          "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings")
_POSITIONS = "model.{}.embed_positions.weight"
_BIAS = "final_logits_bias"
# A start folded into row 0 of the decoder's positions is the embedding of a token to within this (float32
# rounding of √d·E[bos] + PE(0), divided by √d).
_START_TOLERANCE = 1e-5
_TABLE_TOLERANCE = 1e-5  # a stored position table against the sinusoids, each computed in float64, in float32


# ----------------------------------------------------------------------------- the weight map

@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor: its Hugging Face and plainformer names, the axis (if any) that indexes the features of
    the residual stream, and the axis (if any) that indexes the vocabulary."""

    hf: str
    ours: str
    features: int | None = None
    vocab: int | None = None


# Sublayer (Hugging Face, ours) and the tensor's feature axis for its weight and its bias: a matrix that
# reads the stream (in-features: axis 1 of the weight), one that writes it (out-features: axis 0 of both),
# or a LayerNorm (axis 0 of both).
_READS, _WRITES, _NORM = (1, None), (0, 0), (0, 0)
_ATTENTION = (("q_proj", "W_q", _READS), ("k_proj", "W_k", _READS), ("v_proj", "W_v", _READS),
              ("out_proj", "W_o", _WRITES))
_FEED_FORWARD = (("fc1", "ff.W_1", _READS), ("fc2", "ff.W_2", _WRITES))
_SUBLAYERS = {
    "encoder": (*((f"self_attn.{h}", f"self_attn.{o}", a) for h, o, a in _ATTENTION),
                ("self_attn_layer_norm", "norm1", _NORM), *_FEED_FORWARD, ("final_layer_norm", "norm2", _NORM)),
    "decoder": (*((f"self_attn.{h}", f"self_attn.{o}", a) for h, o, a in _ATTENTION),
                ("self_attn_layer_norm", "norm1", _NORM),
                *((f"encoder_attn.{h}", f"cross_attn.{o}", a) for h, o, a in _ATTENTION),
                ("encoder_attn_layer_norm", "norm2", _NORM), *_FEED_FORWARD, ("final_layer_norm", "norm3", _NORM)),
}


def marian_entries(config: TransformerConfig) -> list[Entry]:
    """Every tensor of a Transformer with this config but final_logits_bias, as MarianMTModel names it: the
    embeddings (one shared matrix, or the encoder's and the decoder's), lm_head where it is not tied, the
    layers'."""
    rows, columns = 0, 1  # an embedding's axes: tokens, features
    if config.share_embeddings:
        entries = [Entry("model.shared.weight", "encoder.embedding.weight", columns, rows)]
    else:
        entries = [Entry(f"model.{stack}.embed_tokens.weight", f"{stack}.embedding.weight", columns, rows)
                   for stack in ("encoder", "decoder")]
    if not config.tie_weights:
        entries.append(Entry("lm_head.weight", "output.weight", columns, rows))
    for stack, n_layers in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
        for i in range(n_layers):
            for hf, ours, axes in _SUBLAYERS[stack]:
                for kind, axis in zip(("weight", "bias"), axes, strict=True):
                    entries.append(Entry(f"model.{stack}.layers.{i}.{hf}.{kind}", f"{stack}.layers.{i}.{ours}.{kind}",
                                         axis))
    return entries


def marian_features(d_model: int) -> Tensor:
    """perm (d_model,): Marian's feature k is our feature perm[k] (its sines first, then its cosines)."""
    return torch.cat((torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)))


def _moved(tensor: Tensor, entry: Entry, features: Tensor, vocab: Tensor | None) -> Tensor:
    """`tensor` with its feature axis indexed by `features` and its vocabulary axis by `vocab`."""
    if entry.vocab is not None and vocab is not None:
        tensor = tensor.index_select(entry.vocab, vocab)
    if entry.features is not None:
        tensor = tensor.index_select(entry.features, features)
    return tensor.contiguous()


def marian_table(max_len: int, d_model: int) -> Tensor:
    """Marian's sinusoidal position table (max_len, d_model), float32: ours, its features permuted."""
    return sinusoidal_table(max_len, d_model, torch.float64)[:, marian_features(d_model)].float()


# ----------------------------------------------------------------------------- config.json

def marian_order(config: TransformerConfig) -> Tensor:
    """Our id of each Marian id (V,): ours in their order, pad moved last (Marian's <pad>)."""
    ids = [i for i in range(config.tgt_vocab_size) if i != config.pad_id]
    return torch.tensor([*ids, config.pad_id])


def marian_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of a Transformer with this config (its ids in `marian_order`). A ValueError names the
    field Marian cannot express."""
    refusals = {
        "norm_first": (config.norm_first, "pre-LN has no Marian layout: Marian normalises after each sublayer"),
        "n_kv_heads": (config.n_kv_heads not in (None, config.n_heads),
                       "grouped-query attention has no Marian layout (n_kv_heads must be None or n_heads)"),
        "activation": (config.activation not in MARIAN_ACTIVATIONS,
                       f"Marian's feed-forward takes one of {', '.join(MARIAN_ACTIVATIONS)}"),
        "src_vocab_size": (config.src_vocab_size != config.tgt_vocab_size,
                           "Marian's tokenizer gives both sides one vocabulary (vocab.json): src_vocab_size must "
                           "equal tgt_vocab_size"),
        "source_eos": (not config.source_eos, "Marian's tokenizer ends every source with </s>, and this model was "
                                              "trained on sources without it"),
    }
    for name, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"{name}={getattr(config, name)!r}: {why}")
    pad = config.tgt_vocab_size - 1
    eos = config.eos_id - (config.eos_id > config.pad_id)  # the ids after pad move down by one
    dropout = config.dropout
    return {
        "architectures": ["MarianMTModel"], "model_type": "marian", "is_encoder_decoder": True,
        "vocab_size": config.tgt_vocab_size, "decoder_vocab_size": config.tgt_vocab_size, "d_model": config.d_model,
        "encoder_layers": config.encoder_layers, "decoder_layers": config.decoder_layers,
        "encoder_attention_heads": config.n_heads, "decoder_attention_heads": config.n_heads,
        "encoder_ffn_dim": config.d_ff, "decoder_ffn_dim": config.d_ff,
        "activation_function": MARIAN_ACTIVATIONS[config.activation], "dropout": dropout,
        "attention_dropout": dropout if config.attention_dropout is None else config.attention_dropout,
        "activation_dropout": dropout if config.activation_dropout is None else config.activation_dropout,
        "max_position_embeddings": config.max_len, "scale_embedding": True,
        "share_encoder_decoder_embeddings": config.share_embeddings, "tie_word_embeddings": config.tie_weights,
        "pad_token_id": pad, "eos_token_id": eos, "decoder_start_token_id": pad, "bos_token_id": None,
        "forced_eos_token_id": None, "dtype": "float32",
    }


def _generation_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json: pad starts the decoder and is never generated (opus-mt's rule), no end forced at
    the length limit (ours forces none), greedy unless asked."""
    pad = hf["pad_token_id"]
    return {"decoder_start_token_id": pad, "eos_token_id": hf["eos_token_id"], "pad_token_id": pad,
            "bad_words_ids": [[pad]], "forced_eos_token_id": None, "max_length": hf["max_position_embeddings"]}


def transformer_config_from_marian(hf: Mapping[str, Any]) -> TransformerConfig:
    """The TransformerConfig of a Marian config.json (output_bias and, where the start is folded into the
    positions, bos_id are the weights' to say: see `load_marian`)."""
    if hf.get("model_type") != "marian":
        raise ValueError(f"config.json describes a {hf.get('model_type')!r} model, not a 'marian' one")
    missing = [key for key in _SIZES if key not in hf]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    for key in _SIZES:
        if not (_checks.is_int(hf[key]) and hf[key] > 0):
            raise ValueError(f"config.json: {key} must be a positive integer, got {hf[key]!r}")
    for encoder, decoder in (("encoder_attention_heads", "decoder_attention_heads"),
                             ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf[encoder] != hf[decoder]:
            raise ValueError(f"config.json: {encoder}={hf[encoder]} and {decoder}={hf[decoder]} differ; plainformer's "
                             "encoder and decoder layers have one shape")
    if hf.get("decoder_vocab_size") not in (None, hf["vocab_size"]):
        raise ValueError(f"config.json: decoder_vocab_size={hf['decoder_vocab_size']} differs from vocab_size="
                         f"{hf['vocab_size']}: plainformer reads one vocabulary shared by both sides")
    if not hf.get("scale_embedding", False):
        raise ValueError("config.json: scale_embedding=False is not supported: plainformer scales the embeddings "
                         "by √d_model, as the paper does")
    if hf.get("normalize_before", False):
        raise ValueError("config.json: normalize_before=True (pre-LN) is not Marian's layout")
    activation = hf.get("activation_function", "gelu")
    if activation not in _FROM_MARIAN_ACTIVATIONS:
        raise ValueError(f"config.json: activation_function={activation!r} is not supported; expected one of "
                         f"{', '.join(_FROM_MARIAN_ACTIVATIONS)}")
    ids: dict[str, int] = {}
    for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        value = hf.get(key)
        if not _checks.is_int(value):
            raise ValueError(f"config.json: {key} must be one token id, got {value!r}")
        ids[key] = value
    try:
        return TransformerConfig(
            src_vocab_size=hf["vocab_size"], tgt_vocab_size=hf["vocab_size"], n_layers=hf["encoder_layers"],
            n_decoder_layers=hf["decoder_layers"], n_heads=hf["encoder_attention_heads"], d_model=hf["d_model"],
            d_ff=hf["encoder_ffn_dim"], dropout=hf.get("dropout", 0.1),
            attention_dropout=hf.get("attention_dropout", 0.0), activation_dropout=hf.get("activation_dropout", 0.0),
            activation=_FROM_MARIAN_ACTIVATIONS[activation],
            share_embeddings=hf.get("share_encoder_decoder_embeddings", True),
            tie_weights=hf.get("tie_word_embeddings", True), max_len=hf["max_position_embeddings"],
            pad_id=ids["pad_token_id"], bos_id=ids["decoder_start_token_id"], eos_id=ids["eos_token_id"],
            source_eos=True)
    except (TypeError, ValueError) as error:
        raise ValueError(f"config.json: {error}") from None


# ----------------------------------------------------------------------------- save

def _tokenizer_pieces(tokenizer: Tokenizer, config: TransformerConfig) -> tuple[bytes, bytes, list[str]]:
    """(source.spm, target.spm, the piece of each of our ids) of a SentencePiece or Marian tokenizer."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        source = target = tokenizer.model_bytes
    elif isinstance(tokenizer, MarianTokenizer):
        source, target = tokenizer.source_model, tokenizer.target_model
    else:
        raise ValueError(f"a Marian directory's tokenizer is SentencePiece (source.spm, target.spm, vocab.json); "
                         f"this model's is a {tokenizer.kind!r} tokenizer")
    if tokenizer.vocab_size != config.tgt_vocab_size:
        raise ValueError(f"the tokenizer's {tokenizer.vocab_size} pieces are not the model's "
                         f"{config.tgt_vocab_size}-token vocabulary")
    pieces = [str(tokenizer.id_to_token(i)) for i in range(tokenizer.vocab_size)]
    for name, piece in (("pad_id", PAD), ("eos_id", EOS)):
        if pieces[getattr(config, name)] != piece:
            raise ValueError(f"{name}={getattr(config, name)} is the piece {pieces[getattr(config, name)]!r}; "
                             f"Marian's tokenizer needs it to be {piece!r}")
    if UNK not in pieces:
        raise ValueError(f"the tokenizer has no {UNK!r} piece, which Marian's tokenizer needs")
    return source, target, pieces


def _write_tokenizer(directory: Path, source: bytes, target: bytes, vocab: Mapping[str, int], max_len: int) -> None:
    settings = {"tokenizer_class": "MarianTokenizer", "model_max_length": max_len, "separate_vocabs": False,
                "pad_token": PAD, "eos_token": EOS, "unk_token": UNK}
    files: dict[str, str | bytes] = {
        MarianTokenizer.SOURCE_FILE: source, MarianTokenizer.TARGET_FILE: target,
        MarianTokenizer.VOCAB_FILE: json.dumps(vocab, ensure_ascii=False, indent=1),
        TOKENIZER_CONFIG: json.dumps(settings, indent=1)}
    write_files(directory, files)


def save_marian(model: Transformer, directory: str | os.PathLike, *, tokenizer: Tokenizer | None = None) -> Path:
    """Write `model` as a Marian directory: config.json, generation_config.json, model.safetensors, and with
    `tokenizer` (default: the model's; SentencePiece or Marian) source.spm, target.spm, vocab.json and
    tokenizer_config.json. transformers' MarianMTModel.from_pretrained and MarianTokenizer load it; every
    file is written atomically. A ValueError names what Marian cannot express, before anything is written."""
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a Transformer, got {type(model).__name__}")
    config = model.config
    hf = marian_config(config)
    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    files = _tokenizer_pieces(tokenizer, config) if tokenizer is not None else None
    order = marian_order(config)
    tensors = _marian_state(model, order)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with reporting_full_disk(directory / SAFETENSORS, "weights"), atomic_path(directory / SAFETENSORS) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    write_hf_config(directory, hf)
    with atomic_path(directory / GENERATION_CONFIG) as tmp:
        tmp.write_text(json.dumps(_generation_config(hf), indent=2) + "\n")
    if files is not None:
        source, target, pieces = files
        _write_tokenizer(directory, source, target, {pieces[i]: k for k, i in enumerate(order.tolist())},
                         config.max_len)
    return directory


def _marian_state(model: Transformer, order: Tensor) -> dict[str, Tensor]:
    """MarianMTModel's tensors of `model` (float32), its vocabulary in the Marian order `order`, pad's row
    zeroed and the start folded into row 0 of the decoder's positions (see the module docstring)."""
    config = model.config
    state = {name: tensor.detach().cpu().float() for name, tensor in model.state_dict().items()}
    features = marian_features(config.d_model)
    tensors = {e.hf: _moved(state[e.ours], e, features, order) for e in marian_entries(config)}
    bias = state["output.bias"] if config.output_bias else torch.zeros(config.tgt_vocab_size)
    tensors[_BIAS] = bias[order].unsqueeze(0).contiguous()
    start = math.sqrt(config.d_model) * state["decoder.embedding.weight"][config.bos_id]  # (d_model,), ours
    decoder_input = "model.shared.weight" if config.share_embeddings else "model.decoder.embed_tokens.weight"
    tensors[decoder_input][-1] = 0.0  # pad, the start: Marian's zero vector
    if config.share_embeddings and not config.tie_weights:
        # transformers ties each stack's embed_tokens to model.shared only where it ties lm_head too: both
        # are written, as copies (safetensors holds no two views of one tensor)
        for stack in ("encoder", "decoder"):
            tensors[f"model.{stack}.embed_tokens.weight"] = tensors["model.shared.weight"].clone()
    if start.any():
        table = sinusoidal_table(config.max_len, config.d_model, torch.float64)
        table[0] += start.double()
        tensors[_POSITIONS.format("decoder")] = table[:, features].float().contiguous()
    return tensors


# ----------------------------------------------------------------------------- load

def load_marian(directory: str | os.PathLike, *, backend: str = "auto") -> Transformer:
    """The Transformer (in eval mode) of a Marian directory, with its tokenizer (source.spm, target.spm,
    vocab.json) as `.tokenizer` where it has one. A ValueError names what plainformer cannot read."""
    directory = Path(directory)
    config = transformer_config_from_marian(read_hf_config(directory)).replace(backend=backend)
    state, config = _state_from_marian(read_sharded_hf_weights(directory), config)
    model = Transformer(config)
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise ValueError(f"the weights in {directory} do not fit its config.json: {error}") from None
    model.tokenizer = None
    if (directory / MarianTokenizer.VOCAB_FILE).is_file():
        model.tokenizer = MarianTokenizer.from_directory(directory)
        if model.tokenizer.vocab_size != config.tgt_vocab_size:
            raise ValueError(f"{directory}: vocab.json holds {model.tokenizer.vocab_size} pieces, config.json's "
                             f"vocab_size is {config.tgt_vocab_size}")
    return model.eval()


def _state_from_marian(weights: Mapping[str, Tensor], config: TransformerConfig
                       ) -> tuple[dict[str, Tensor], TransformerConfig]:
    """Our state dict (aliases of shared and tied matrices included) and the config completed by the weights:
    output_bias where final_logits_bias is not zero, bos_id where a start is folded into the positions."""
    weights = {name: tensor.float() for name, tensor in weights.items()}
    entries = marian_entries(config)
    _fill_aliases(weights, config)
    missing = [e.hf for e in entries if e.hf not in weights]
    if missing:
        raise ValueError(f"missing weights for this Marian config: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    known = {e.hf for e in entries} | {_BIAS, *(_POSITIONS.format(s) for s in ("encoder", "decoder"))}
    unknown = sorted(set(weights) - known)
    if unknown:
        raise ValueError(f"unexpected weights for this Marian config: {', '.join(unknown[:5])}"
                         f"{' ...' if len(unknown) > 5 else ''}")
    back = torch.argsort(marian_features(config.d_model))  # our feature j is Marian's back[j]
    state = {e.ours: _moved(weights[e.hf], e, back, None) for e in entries}
    bias = weights.get(_BIAS, torch.zeros(1, config.tgt_vocab_size)).reshape(-1)
    if bias.shape != (config.tgt_vocab_size,):
        raise ValueError(f"{_BIAS} has {bias.numel()} entries, the vocabulary {config.tgt_vocab_size}")
    if bias.any():
        config = config.replace(output_bias=True)
        state["output.bias"] = bias
    if config.share_embeddings:
        state["decoder.embedding.weight"] = state["encoder.embedding.weight"]
    if config.tie_weights:
        state["output.weight"] = state["decoder.embedding.weight"]
    bos = _folded_start(weights, config, state["decoder.embedding.weight"], back)
    return state, config.replace(bos_id=bos)


def _fill_aliases(weights: dict[str, Tensor], config: TransformerConfig) -> None:
    """Older directories also hold the shared embedding as each stack's embed_tokens and the tied lm_head:
    each must equal the matrix it stands for, and is dropped."""
    aliases = {}
    if config.share_embeddings:
        aliases.update(dict.fromkeys((f"model.{s}.embed_tokens.weight" for s in ("encoder", "decoder")),
                                     "model.shared.weight"))
    if config.tie_weights:
        aliases["lm_head.weight"] = ("model.shared.weight" if config.share_embeddings
                                     else "model.decoder.embed_tokens.weight")
    for alias, name in aliases.items():
        if alias not in weights:
            continue
        tensor = weights.pop(alias)
        weights.setdefault(name, tensor)
        if not torch.equal(weights[name], tensor):
            raise ValueError(f"{alias} differs from {name}, which config.json says it is (shared or tied)")


def _folded_start(weights: Mapping[str, Tensor], config: TransformerConfig, embedding: Tensor, back: Tensor) -> int:
    """bos_id: decoder_start_token_id, or, where the stored decoder position table's row 0 adds a vector v
    to Marian's sinusoid, the token t with √d·E[t] = √d·E[start] + v. Stored tables must otherwise be the
    sinusoids."""
    table = marian_table(config.max_len, config.d_model)
    for stack in ("encoder", "decoder"):
        stored = weights.get(_POSITIONS.format(stack))
        if stored is None:
            continue
        rows = slice(1, None) if stack == "decoder" else slice(None)
        if stored.shape != table.shape or not torch.allclose(stored[rows], table[rows], atol=_TABLE_TOLERANCE, rtol=0):
            raise ValueError(f"{_POSITIONS.format(stack)} is not Marian's sinusoidal table of "
                             f"{config.max_len} x {config.d_model}; plainformer's positions are those sinusoids")
    stored = weights.get(_POSITIONS.format("decoder"))
    if stored is None or torch.allclose(stored[0], table[0], atol=_TABLE_TOLERANCE, rtol=0):
        return config.bos_id
    start = embedding[config.bos_id] + (stored[0] - table[0])[back] / math.sqrt(config.d_model)
    distance = (embedding - start).abs().amax(dim=1)  # (V,)
    token = int(distance.argmin())
    if distance[token] > _START_TOLERANCE or token == config.eos_id:
        raise ValueError(f"row 0 of {_POSITIONS.format('decoder')} adds to Marian's sinusoid a start that is "
                         "no token's embedding: plainformer's decoder starts from a token")
    return token
