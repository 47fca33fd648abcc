"""Learned shortcuts from the first layer to every later one, as in modded-nanogpt's speedrun records.

Value residual (Zhou et al. 2024, "Value Residual Learning"), in the attention of each layer l ≥ 2:

    v_l ← λ_l · v_l + (1 − λ_l) · v_1        v: the values W^V x, (B, H_kv, n, d_k); λ_l learned, 0.5 at start

so that every layer reads the first layer's values besides its own; layer 1 keeps its own (and has no λ).

Embedding shortcut ("x0"), at the input of every block l:

    x ← a_l · x + b_l · x0                   x0: the embedding output (B, n, d_model); a_l = 1, b_l = 0 at start

A `models.gpt.VariantBlock` applies both: its GPT hands every block x0 and the first block's values v_1.
The scalars are 1-element vectors, not 0-d tensors: FSDP2 shards every parameter along its first axis.
They are cast to the dtype of what they scale, so that a float32 scalar leaves a bfloat16 tensor bfloat16.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ValueResidual(nn.Module):
    """v_l ← λ · v_l + (1 − λ) · v_1 for one layer l ≥ 2: `lam` (1,), 0.5 at start (modded-nanogpt's)."""

    def __init__(self, init: float = 0.5):
        super().__init__()
        self.lam = nn.Parameter(torch.full((1,), init))

    def forward(self, v: Tensor, v1: Tensor) -> Tensor:
        """v, v1: (B, H_kv, n, d_k) -> the same shape."""
        lam = self.lam.to(v.dtype)
        return lam * v + (1 - lam) * v1


class EmbeddingShortcut(nn.Module):
    """x ← a · x + b · x0 at a block's input: `a` (1,) = 1 and `b` (1,) = 0 at start, so that the block
    starts as it is without the shortcut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(1))
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor, x0: Tensor) -> Tensor:
        """x, x0: (B, n, d_model) -> the same shape."""
        return self.a.to(x.dtype) * x + self.b.to(x.dtype) * x0
