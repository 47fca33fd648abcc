"""Sentence embeddings from a BERT: mean pooling over real tokens, then L2 normalisation
(Reimers & Gurevych 2019, Sentence-BERT; the recipe of all-MiniLM-L6-v2).

    h = BERT(tokens)                           (B, n, d_model)
    u = Σ_i m_i h_i / Σ_i m_i                  (B, d_model), m_i = 1 for real tokens, 0 for padding
    embedding = u / ‖u‖₂                       so that a dot product is the cosine similarity

`encode` tokenizes every sentence, sorts them by length so that each batch pads little, runs the
batches and returns the embeddings in the caller's order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from ..checkpoint.format import load_checkpoint
from ..data.tokenizers import WordPieceTokenizer
from ..files.json_file import read_json_object
from ..models.bert import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel
from .bert import (
    load_hf_bert,
    load_hf_bert_tokenizer,
    resolve_bert_path,
)
from .directory import HF_CONFIG

# sentence-transformers' files next to a Hugging Face model: its maximum length and its pooling.
ST_CONFIG = "sentence_bert_config.json"
ST_POOLING = Path("1_Pooling") / "config.json"
# The families whose checkpoints hold a BERT encoder, and the prefix of its weights there.
ENCODER_PREFIX = {BertModel.family: "", BertForMaskedLM.family: "bert.", BertForSequenceClassification.family: "bert."}


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """Σ_i m_i h_i / Σ_i m_i: hidden (B, n, d), mask (B, n) bool -> (B, d); computed in float32."""
    weights = mask.unsqueeze(-1).to(torch.float32)  # (B, n, 1)
    summed = (hidden.float() * weights).sum(dim=1)  # (B, d)
    return summed / weights.sum(dim=1).clamp_min(1.0)


def load_bert(name_or_dir: str | os.PathLike, *, backend: str = "auto"
              ) -> tuple[BertModel, WordPieceTokenizer]:
    """The encoder and tokenizer of "minilm", a Hugging Face BERT directory, or a plainformer checkpoint
    of a BERT family (the encoder of a masked-LM or classifier is taken without its head)."""
    directory = resolve_bert_path(name_or_dir)
    if (directory / "manifest.json").is_file():
        return _load_checkpoint_bert(directory, backend)
    if not (directory / HF_CONFIG).is_file():
        raise FileNotFoundError(f"{directory} holds neither a plainformer checkpoint (manifest.json) nor "
                                f"a Hugging Face model ({HF_CONFIG})")
    return load_hf_bert(directory, backend=backend), load_hf_bert_tokenizer(directory)


def _load_checkpoint_bert(directory: Path, backend: str) -> tuple[BertModel, WordPieceTokenizer]:
    checkpoint = load_checkpoint(directory)
    if checkpoint.family not in ENCODER_PREFIX:
        raise ValueError(f"{directory} holds a {checkpoint.family!r} model; expected one of "
                         f"{', '.join(ENCODER_PREFIX)}")
    config = checkpoint.config(BertConfig).replace(backend=backend)
    model = checkpoint.restore_model(BertModel(config), prefix=ENCODER_PREFIX[checkpoint.family])
    tokenizer = checkpoint.load_tokenizer()
    if not isinstance(tokenizer, WordPieceTokenizer):
        raise ValueError(f"{directory} holds a {tokenizer.kind} tokenizer; a BERT needs a WordPiece one")
    return model.eval(), tokenizer


def _sentence_transformers_max_len(directory: Path) -> int | None:
    """max_seq_length from sentence_bert_config.json; checks the pooling is the mean, as here."""
    pooling = directory / ST_POOLING
    if pooling.is_file():
        modes = {k: v for k, v in read_json_object(pooling).items() if k.startswith("pooling_mode")}
        if any(v for k, v in modes.items() if k != "pooling_mode_mean_tokens"):
            raise ValueError(f"{pooling} asks for pooling {modes}; SentenceEncoder pools by the mean only")
    config = directory / ST_CONFIG
    return read_json_object(config).get("max_seq_length") if config.is_file() else None


class SentenceEncoder(nn.Module):
    """A BERT (`.bert`) and its WordPiece tokenizer (`.tokenizer`) that embed sentences as unit vectors.

    Sentences longer than `max_len` tokens ([CLS] and [SEP] included) are truncated, keeping [SEP].
    """

    def __init__(self, bert: BertModel, tokenizer: WordPieceTokenizer, *, max_len: int | None = None):
        super().__init__()
        if not isinstance(bert, BertModel):
            raise TypeError(f"bert must be a BertModel, got {type(bert).__name__}")
        if not isinstance(tokenizer, WordPieceTokenizer):
            raise TypeError(f"tokenizer must be a WordPieceTokenizer, got {type(tokenizer).__name__}")
        if tokenizer.vocab_size > bert.config.vocab_size:
            raise ValueError(f"the tokenizer's vocabulary ({tokenizer.vocab_size}) is larger than the "
                             f"model's vocab_size ({bert.config.vocab_size})")
        max_len = bert.config.max_len if max_len is None else _checks.check_positive_int("max_len", max_len)
        if not 2 < max_len <= bert.config.max_len:
            raise ValueError(f"max_len must be in (2, {bert.config.max_len}] (the model's position table), "
                             f"got {max_len}")
        self.bert, self.tokenizer, self.max_len = bert, tokenizer, max_len

    @classmethod
    def from_pretrained(cls, name_or_dir: str | os.PathLike = "minilm", *, backend: str = "auto",
                        max_len: int | None = None) -> SentenceEncoder:
        """"minilm" (the packaged all-MiniLM-L6-v2), a Hugging Face / sentence-transformers BERT
        directory, or a plainformer BERT checkpoint. max_len defaults to sentence-transformers'
        max_seq_length when the directory has one (256 for MiniLM), else the model's max_len."""
        directory = resolve_bert_path(name_or_dir)
        bert, tokenizer = load_bert(directory, backend=backend)
        if max_len is None:
            max_len = _sentence_transformers_max_len(directory)
        return cls(bert, tokenizer, max_len=max_len).eval()

    @property
    def dim(self) -> int:
        return self.bert.config.d_model

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """(B, n) ids -> (B, d_model) unit-norm float32 embeddings."""
        hidden = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
        mask = input_ids != self.tokenizer.pad_id if attention_mask is None else attention_mask.bool()
        return F.normalize(mean_pool(hidden, mask), p=2.0, dim=-1)

    def tokenize(self, sentences: Sequence[str]) -> list[list[int]]:
        """[CLS] wordpieces [SEP] per sentence, truncated to max_len with [SEP] kept last."""
        ids = [self.tokenizer.encode(s) for s in sentences]
        return [x if len(x) <= self.max_len else x[:self.max_len - 1] + x[-1:] for x in ids]

    def collate(self, ids: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """Right-pad token id lists to the longest: (input_ids (B, n) long, attention_mask (B, n) bool)."""
        longest = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), longest), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), longest), dtype=torch.bool)
        for row, x in enumerate(ids):
            input_ids[row, :len(x)] = torch.tensor(x, dtype=torch.long)
            mask[row, :len(x)] = True
        return input_ids, mask

    @torch.inference_mode()
    def encode(self, sentences: str | Sequence[str], batch_size: int = 32, *,
               dtype: torch.dtype | None = None) -> Tensor:
        """Embeddings (N, d_model) float32 of N sentences (a single str gives (d_model,)), in order.

        dtype: compute in this precision under autocast (torch.bfloat16 on CPU or GPU, torch.float16
        on GPU); None computes in the weights' own dtype.
        """
        single = isinstance(sentences, str)
        texts = [sentences] if isinstance(sentences, str) else _check_sentences(sentences)
        out = self.encode_ids(self.tokenize(texts), batch_size, dtype=dtype)
        return out[0] if single else out

    @torch.inference_mode()
    def encode_ids(self, ids: Sequence[Sequence[int]], batch_size: int = 32, *,
                   dtype: torch.dtype | None = None) -> Tensor:
        """`encode` of sentences already tokenized (`tokenize`'s lists, each at most max_len ids):
        (N, d_model) float32, in order."""
        _checks.check_positive_int("batch_size", batch_size)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        device = next(self.parameters()).device
        out = torch.empty((len(ids), self.dim), dtype=torch.float32, device=device)
        with self._precision(dtype, device):
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                input_ids, mask = self.collate([ids[i] for i in rows])
                out[rows] = self(input_ids.to(device), mask.to(device)).float()
        return out

    def _precision(self, dtype: torch.dtype | None, device: torch.device):
        if dtype is None or dtype == next(self.parameters()).dtype:
            return contextlib.nullcontext()
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be None, torch.bfloat16 or torch.float16, got {dtype}")
        return torch.autocast(device.type, dtype=dtype)


def _check_sentences(sentences: object) -> list[str]:
    if not isinstance(sentences, Sequence):
        raise TypeError(f"sentences must be a str or a list of str, got {type(sentences).__name__}")
    bad = next((s for s in sentences if not isinstance(s, str)), None)
    if bad is not None:
        raise TypeError(f"sentences must hold only str, got an item of type {type(bad).__name__}")
    return list(sentences)
