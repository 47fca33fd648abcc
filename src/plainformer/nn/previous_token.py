"""Embeddings that read the previous token too, as in modded-nanogpt's later speedrun records.

For the token x_t at position t with predecessor x_{t−1} (none at a sequence's first position, or after
padding):

    token shift ("smear"):  e_t ← e_t + σ(g) ⊙ E[x_{t−1}]         g (d_model,) learned, 0 at start
    bigram embedding:       e_t ← e_t + B[x_{t−1} · V + x_t]       B (V², d_model) learned, 0 at start

E is the token embedding and V the vocabulary's size: the bigram table is exact (a row per pair, no hash),
which suits a character vocabulary (65² = 4,225 rows). A position without a predecessor gets neither term.
Decoding with a KV cache feeds the new tokens alone, so the predecessor of the first of them is the
cache's newest token (`KVCache.last_tokens`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def previous_tokens(idx: Tensor, offset: int, last: Tensor | None,
                    attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The predecessor of each position of idx (B, n), which sits at positions offset .. offset+n-1:
    (ids (B, n), has (B, n) bool: whether there is one).

    last (B,): the token at position offset - 1 (a KV cache's newest), None when offset is 0.
    attention_mask (B, offset + n), True = real token: a padding predecessor is none. Where `has` is
    False the id is a placeholder (a valid index, never read)."""
    first = idx[:, :1] if last is None else last[:, None]
    ids = torch.cat((first, idx[:, :-1]), dim=1)  # (B, n)
    if attention_mask is not None:
        before = torch.zeros_like(attention_mask[:, :1])  # the first position has none
        has = torch.cat((before, attention_mask), dim=1)[:, offset:offset + idx.shape[1]]
    else:
        has = torch.ones_like(idx, dtype=torch.bool)
        if last is None:
            has[:, 0] = False
    return ids, has


class TokenShift(nn.Module):
    """e_t ← e_t + σ(g) ⊙ E[x_{t−1}]: `gate` g (d_model,), zero at start (σ(0) = 1/2)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(d_model))

    def forward(self, previous: Tensor, has: Tensor) -> Tensor:
        """previous: E[x_{t−1}] (B, n, d_model), has (B, n) -> the term to add (B, n, d_model)."""
        return (torch.sigmoid(self.gate).to(previous.dtype) * previous).masked_fill(~has[..., None], 0.0)


class BigramEmbedding(nn.Module):
    """B[x_{t−1} · V + x_t]: `table` an nn.Embedding of V² rows, zero at start, so that the model starts
    as the one without it and each row learns from its own pair's gradient alone."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.table = nn.Embedding(vocab_size * vocab_size, d_model)
        nn.init.zeros_(self.table.weight)

    def forward(self, idx: Tensor, previous: Tensor, has: Tensor) -> Tensor:
        """idx, previous (B, n) ids, has (B, n) -> the term to add (B, n, d_model)."""
        return self.table(previous * self.vocab_size + idx).masked_fill(~has[..., None], 0.0)
