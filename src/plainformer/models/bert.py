"""BERT: a bidirectional Transformer encoder pretrained by masked language modelling (Devlin et al. 2019).

    h_0 = LayerNorm(E[ids] + P[positions] + T[token_types]),  then dropout
    h_l = EncoderLayer_l(h_{l-1}),  l = 1 .. n_layers      post-LN, GELU, padding keys masked
    pooled = tanh(W_p h_L[:, 0] + b_p)                      the [CLS] position

    masked LM:       logits = LayerNorm(GELU(W_t h_L + b_t)) Eᵀ + b    (decoder tied to E, own bias b)
    classification:  logits = W_c Dropout(pooled) + b_c

Each layer is the foundation's `EncoderLayer` with norm_first=False (`bert_layer`):
x = LN(x + Attn(x, x, x)), x = LN(x + FFN(x)), FFN = GELU(x W_1 + b_1) W_2 + b_2, which is BERT's layer.
Initialisation follows BERT: N(0, init_std) weights, zero biases, LayerNorm (1, 0).
The config is checked when it is built; the modules built from it check nothing again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from ..config import Config, checked, one_of, positive_int, positive_number, probability
from ..constants import IGNORE_INDEX
from ..data.tokenizers import Tokenizer
from ..memory import unchecked
from ..nn.attention import BACKENDS
from ..nn.blocks import EncoderLayer
from ..nn.dtypes import at_least_float32
from ..nn.feedforward import ACTIVATIONS
from ..nn.masks import AttentionMask
from ..nn.positional import LearnedPositionalEmbedding
from .family_model import FamilyModel


def _check_label_names(name: str, value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(item, str) and item for item in value):
        raise TypeError(f"{name} must be a tuple of non-empty str, got {value!r}"[:200])
    if len(set(value)) != len(value):
        raise ValueError(f"{name} must name each class once, got {list(value)}"[:200])


@dataclasses.dataclass
class BertConfig(Config):
    """Shape and options of a BERT. vocab_size is set from the tokenizer when pretraining.

    A classifier's `n_labels` classes are named by `label_names` (Hugging Face's id2label, in id order);
    None names them LABEL_0, LABEL_1, ... as Hugging Face does (`class_names`)."""

    vocab_size: int = positive_int(30522)
    max_len: int = positive_int(512)
    type_vocab_size: int = positive_int(2)
    n_layers: int = positive_int(12)
    n_heads: int = positive_int(12)
    d_model: int = positive_int(768)
    d_ff: int = positive_int(3072)
    dropout: float = probability(0.1)
    attention_dropout: float = probability(0.1)
    norm_eps: float = positive_number(1e-12)
    activation: str = one_of("gelu", ACTIVATIONS)
    backend: str = one_of("auto", BACKENDS)
    pad_id: int | None = 0
    n_labels: int = positive_int(2)
    init_std: float = positive_number(0.02)
    label_names: tuple[str, ...] | None = checked(None, _check_label_names)

    HELP: ClassVar[Mapping[str, str]] = {
        "vocab_size": "wordpieces in the vocabulary (the tokenizer's)",
        "max_len": "positions: the longest text in tokens",
        "type_vocab_size": "token types (segments A and B of a pair)",
        "n_layers": "encoder layers",
        "n_heads": "attention heads",
        "d_model": "width of the residual stream",
        "d_ff": "hidden width of the feed-forward",
        "dropout": "dropout of embeddings and sublayer outputs",
        "attention_dropout": "dropout of the attention weights",
        "norm_eps": "ε of the LayerNorms",
        "activation": "the FFN's",
        "backend": "the attention kernel",
        "pad_id": "the padding token (the tokenizer's)",
        "n_labels": "a classifier's classes (the data's)",
        "init_std": "standard deviation of the initial weights",
        "label_names": "a classifier's class names, in id order (the data's)",
    }
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        # BERT-base (Devlin et al. 2019, section 3): 110M parameters.
        "base": dict(vocab_size=30522, max_len=512, n_layers=12, n_heads=12, d_model=768, d_ff=3072),
        # The shape of sentence-transformers/all-MiniLM-L6-v2 (nreimers/MiniLM-L6-H384-uncased).
        "minilm-l6": dict(vocab_size=30522, max_len=512, n_layers=6, n_heads=12, d_model=384,
                          d_ff=1536),
        # BERT-tiny's shape (Turc et al. 2019, L=2, H=128, A=2) on a short context: pretrains on 2 CPU
        # cores in minutes. vocab_size is replaced by the corpus tokenizer's.
        "tiny": dict(vocab_size=4096, max_len=128, n_layers=2, n_heads=2, d_model=128, d_ff=512),
    }

    def __post_init__(self) -> None:
        if isinstance(self.label_names, list):  # JSON gives a list; the config holds a tuple
            self.label_names = tuple(self.label_names)
        super().__post_init__()

    def validate(self) -> None:
        _checks.check_divisible("d_model", self.d_model, "n_heads", self.n_heads)
        if self.pad_id is not None:
            _checks.check_index("pad_id", self.pad_id, self.vocab_size, "vocab_size")
        if self.label_names is not None and len(self.label_names) != self.n_labels:
            raise ValueError(f"label_names must name the n_labels={self.n_labels} classes, "
                             f"got {len(self.label_names)} names")

    def class_names(self) -> tuple[str, ...]:
        """The classifier's classes in id order: `label_names`, else LABEL_0 .. LABEL_{n_labels-1}."""
        return self.label_names or default_label_names(self.n_labels)


def default_label_names(n_labels: int) -> tuple[str, ...]:
    """Hugging Face's names of unnamed classes: LABEL_0, LABEL_1, ..."""
    return tuple(f"LABEL_{i}" for i in range(n_labels))


class BertOutput(NamedTuple):
    """last_hidden_state (B, n, d_model) and pooler_output (B, d_model); `output[0]` is the former."""

    last_hidden_state: Tensor
    pooler_output: Tensor


class BertEmbeddings(nn.Module):
    """(B, n) ids and token types -> Dropout(LayerNorm(E[ids] + P[0..n-1] + T[types])): (B, n, d_model)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
        self.position = LearnedPositionalEmbedding(config.d_model, config.max_len, validate_args=False)
        self.token_type = nn.Embedding(config.type_vocab_size, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """Ids outside the tables are explained by `_checks.lookup_token_ids`, at no cost otherwise."""
        words = _checks.lookup_token_ids("input_ids", input_ids, self.word.num_embeddings, self.word)
        types = _checks.lookup_token_ids("token_type_ids", token_type_ids, self.token_type.num_embeddings,
                                         self.token_type)
        return self.dropout(self.norm(self.position(words) + types))  # (B, n, d_model)


class BertPooler(nn.Module):
    """tanh(W_p h[:, 0] + b_p): (B, n, d_model) -> (B, d_model)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


def init_bert_weights(module: nn.Module, std: float) -> None:
    """BERT's initialisation of one module (use with `model.apply`)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        with torch.no_grad():
            module.weight[module.padding_idx].zero_()
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def _one_layer_deep(cls: type[FamilyModel], config: BertConfig) -> tuple[BertConfig, dict[str, int]]:
    """BERT's `shallow`: one layer, counted n_layers times."""
    return unchecked(config, n_layers=1), {"layers.0": config.n_layers}


def bert_layer(config: BertConfig) -> EncoderLayer:
    """BERT's layer, as its config says: the post-LN `EncoderLayer` with its own attention dropout."""
    return EncoderLayer(config.d_model, config.n_heads, config.d_ff, dropout=config.dropout,
                        attention_dropout=config.attention_dropout, activation=config.activation,
                        norm_eps=config.norm_eps, backend=config.backend, validate_args=False)


class BertModel(FamilyModel):
    """The encoder: embeddings, n_layers post-LN `EncoderLayer`s and the [CLS] pooler.

    forward(input_ids (B, n), attention_mask (B, n) | None, token_type_ids (B, n) | None) -> BertOutput.
    attention_mask is True (or 1) for real tokens; None means `input_ids != pad_id` (every token when
    pad_id is None). token_type_ids default to 0 (segment A).
    """

    family = "bert"
    config_class = BertConfig
    config: BertConfig
    tokenizer: Tokenizer | None  # set by from_checkpoint and load_hf
    shallow = classmethod(_one_layer_deep)

    def __init__(self, config: BertConfig):
        super().__init__(config)  # checked, and its bytes, before anything is allocated
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(bert_layer(config) for _ in range(config.n_layers))
        self.pooler = BertPooler(config.d_model)
        self.apply(lambda module: init_bert_weights(module, config.init_std))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> BertOutput:
        key_padding_mask, token_type_ids = self._check_inputs(input_ids, attention_mask, token_type_ids)
        n = input_ids.shape[1]
        mask = AttentionMask.build(n, n, key_padding_mask=key_padding_mask, device=input_ids.device)
        x = self.embeddings(input_ids, token_type_ids)  # (B, n, d_model)
        for layer in self.layers:
            x = layer(x, mask)
        return BertOutput(x, self.pooler(x))

    def _check_inputs(self, input_ids: Tensor, attention_mask: Tensor | None,
                      token_type_ids: Tensor | None) -> tuple[Tensor | None, Tensor]:
        """Validated (key padding mask (B, n) bool or None, token types (B, n)): shapes and dtypes,
        no value is read (the embeddings explain ids out of range)."""
        config = self.config
        _checks.check_token_id_tensor("input_ids", input_ids)
        _checks.check_max_len("input_ids", input_ids.shape[1], config.max_len)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        else:
            _checks.check_token_id_tensor("token_type_ids", token_type_ids)
            _checks.check_same_shape("token_type_ids", token_type_ids, "input_ids", input_ids)
        if attention_mask is None:
            mask = None if config.pad_id is None else input_ids != config.pad_id
        else:
            _checks.check_same_shape("attention_mask", attention_mask, "input_ids", input_ids)
            if attention_mask.is_floating_point():
                raise TypeError(f"attention_mask must be boolean or 0/1 integers (True = real token), "
                                f"got dtype {attention_mask.dtype}")
            mask = attention_mask.bool()
        return mask, token_type_ids


class BertMLMHead(nn.Module):
    """logits = LayerNorm(GELU(W_t h + b_t)) Eᵀ + b with E the word embedding: (..., d) -> (..., V)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: Tensor, word_embedding: Tensor) -> Tensor:
        """hidden (..., d_model), word_embedding E (vocab_size, d_model) -> (..., vocab_size)."""
        h = self.norm(F.gelu(self.dense(hidden)))
        return F.linear(h, word_embedding, self.bias)


class BertForMaskedLM(FamilyModel):
    """BERT with the masked-LM head. forward(...) -> (logits, loss | None).

    Without labels: logits (B, n, vocab_size) at every position, loss None.
    With labels (B, n) — the original token at selected positions, IGNORE_INDEX (-100) elsewhere —
    the head runs only at the S selected positions, since no other logit enters the loss, and logits
    is (S, vocab_size) for them in row-major order (matching `labels[labels != -100]`); loss is their
    mean cross-entropy (0 when S = 0). On a 4,096-token vocabulary the head is most of a small
    model's compute, so this makes pretraining several times faster. Its price is the one host
    synchronisation of this forward: S, the size of the selection, is read on the host (free on a CPU;
    on CUDA one sync per step, against a head on every position, ~6x its cost at 15% masking).
    """

    family = "bert-mlm"
    config_class = BertConfig
    config: BertConfig
    tokenizer: Tokenizer | None  # set by from_checkpoint and load_hf
    shallow = classmethod(_one_layer_deep)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.head = BertMLMHead(config)
        self.head.apply(lambda module: init_bert_weights(module, config.init_std))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None,
                labels: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if labels is not None:
            _checks.check_same_shape("labels", labels, "input_ids", input_ids)
        hidden = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state  # (B, n, d)
        embedding = self.bert.embeddings.word.weight
        if labels is None:
            return self.head(hidden, embedding), None
        selected = labels != IGNORE_INDEX  # (B, n)
        logits = self.head(hidden[selected], embedding)  # (S, vocab_size)
        if logits.shape[0] == 0:  # nothing selected: the sum over no positions, 0, still differentiable
            return logits, at_least_float32(logits).sum()
        return logits, F.cross_entropy(at_least_float32(logits), labels[selected])


class BertForSequenceClassification(FamilyModel):
    """BERT with a classifier on the pooled [CLS]. forward(...) -> (logits (B, n_labels), loss | None).

    labels (B,): class indices in [0, n_labels); the loss is their mean cross-entropy.
    """

    family = "bert-cls"
    config_class = BertConfig
    config: BertConfig
    tokenizer: Tokenizer | None  # set by from_checkpoint and load_hf
    shallow = classmethod(_one_layer_deep)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.d_model, config.n_labels)
        init_bert_weights(self.classifier, config.init_std)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None,
                labels: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if labels is not None:
            _checks.check_token_id_tensor("labels", labels, ndim=1, shape_doc="(B,)")
            if labels.shape[0] != input_ids.shape[0]:
                raise ValueError(f"labels must hold one class per sequence ({input_ids.shape[0]}), "
                                 f"got shape {tuple(labels.shape)}")
        pooled = self.bert(input_ids, attention_mask, token_type_ids).pooler_output
        logits = self.classifier(self.dropout(pooled))  # (B, n_labels)
        if labels is None:
            return logits, None
        loss = _checks.lookup_token_ids("labels", labels, self.config.n_labels,
                                        lambda classes: F.cross_entropy(at_least_float32(logits), classes))
        return logits, loss
