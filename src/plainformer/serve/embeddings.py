"""What `/v1/embeddings` computes: a BERT's sentence embeddings, exactly as `plainformer embed` computes them
(`hf.sentence.SentenceEncoder`: mean pooling over real tokens, L2-normalised), or a GPT's final hidden states
pooled as the server was told (`--pooling`), L2-normalised too:

    h = Norm(h_L(tokens))                  (n, d_model), the hidden states the GPT's head reads
    mean:  u = (1/n) Σ_i h_i               last:  u = h_n   (what the last token has seen: all of them)
    embedding = u / ‖u‖₂

A request's `dimensions` k keeps the first k components and makes a unit vector of them again, as OpenAI's
shortened embeddings are, so that their dot products are cosines still: e[:k] / ‖e[:k]‖₂ (`shortened`).

A text longer than a BERT's max_len is truncated as `plainformer embed` truncates it; a list of token ids
longer than it, or any input longer than a GPT's context, is refused with a 400 naming `input`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.tokenizers import Tokenizer
from ..hf.sentence import SentenceEncoder
from ..models.gpt import GPT

POOLINGS = ("mean", "last")
BATCH_SIZE = 32  # `plainformer embed`'s default --batch-size


def shortened(vectors: Tensor, dimensions: int) -> Tensor:
    """Unit vectors (N, d) -> their first `dimensions` components, each row divided by its L2 norm: (N, dimensions)."""
    return F.normalize(vectors[:, :dimensions], dim=1)


class Embedder(Protocol):
    """Token ids -> unit vectors: `tokenize` a text as the model embeds it, then `embed` lists of at most
    `max_len` ids."""

    tokenizer: Tokenizer
    max_len: int
    truncates: bool  # a text longer than max_len is cut (True), or refused (False)

    def tokenize(self, text: str) -> list[int]: ...

    def embed(self, ids: Sequence[list[int]]) -> Tensor: ...


class SentenceEmbedder:
    """A BERT's embeddings as `plainformer embed --dtype` computes them (dtype None: the weights')."""

    truncates = True

    def __init__(self, encoder: SentenceEncoder, *, dtype: torch.dtype | None = None):
        self.encoder, self.dtype = encoder, dtype
        self.tokenizer: Tokenizer = encoder.tokenizer
        self.max_len = encoder.max_len
        self._lock = threading.Lock()  # one batch at a time: what bounds the memory requests take

    def tokenize(self, text: str) -> list[int]:
        return self.encoder.tokenize([text])[0]

    def embed(self, ids: Sequence[list[int]]) -> Tensor:
        """(N, d_model) float32."""
        with self._lock:
            return self.encoder.encode_ids(ids, BATCH_SIZE, dtype=self.dtype)


class PooledGPT:
    """A GPT's final hidden states, pooled by `pooling` ("mean" or "last") and L2-normalised (module
    docstring); each input runs alone, so that nothing but its own tokens enters its embedding."""

    truncates = False

    def __init__(self, model: GPT, pooling: str):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        if model.tokenizer is None:
            raise ValueError("the model has no tokenizer, so text cannot be encoded")
        self.model, self.pooling = model, pooling
        self.tokenizer: Tokenizer = model.tokenizer
        self.max_len = model.config.block_size
        self._lock = threading.Lock()

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    @torch.inference_mode()
    def embed(self, ids: Sequence[list[int]]) -> Tensor:
        """(N, d_model) float32."""
        device = self.model.token_embedding.weight.device
        pooled = []
        with self._lock:
            for x in ids:
                h = self.model.norm(self.model.hidden_states(torch.tensor([x], device=device)))[0]  # (n, d_model)
                pooled.append(h.float().mean(dim=0) if self.pooling == "mean" else h[-1].float())
        return F.normalize(torch.stack(pooled), p=2.0, dim=-1)  # (N, d_model)
