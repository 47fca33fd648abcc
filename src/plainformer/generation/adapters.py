"""Model adapters: a model as the decoding loops drive it (see `decoding.IncrementalDecoder`).

Nothing here imports a model: an adapter reads the few attributes it names, so `models/` may build
its adapters from here without an import cycle.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from ..nn.linear import linear


class _LanguageModel(Protocol):
    """What `GPTDecoder` reads from a GPT."""

    block_size: int
    lm_head: torch.nn.Linear
    norm: torch.nn.Module

    def hidden_states(self, idx: Tensor, *, kv_caches: list[Any] | None = None) -> Tensor: ...

    def new_kv_caches(self, batch_size: int) -> list[Any]: ...


class GPTDecoder:
    """A GPT as `generation` drives it: model(idx, kv_caches) -> (logits (B, 1, V), None), the logits
    of the last position only, which is all that sampling reads.

    On CPU one token reads every weight once and memory bandwidth sets the pace. In fp32 the output
    projection x Eᵀ uses a copy of E (V, d_model) laid out as Eᵀ (d_model, V), made once per decoder
    and freed with it: for one row, MKL streams GPT-2's 154 MB output weight at ~21 GB/s in that
    layout against ~12 GB/s from (V, d_model) (one core). In bf16, one row goes through the
    matrix-vector kernel instead (`nn.linear.linear`), which reads E as it is.
    """

    def __init__(self, model: _LanguageModel):
        self.model = model
        self.block_size = model.block_size
        weight = model.lm_head.weight.detach()
        self.output_weight = weight
        self.output_weight_t = weight.t().contiguous() if weight.dtype == torch.float32 else None

    def new_kv_caches(self, batch_size: int) -> list[Any]:
        return self.model.new_kv_caches(batch_size)

    def __call__(self, idx: Tensor, *, kv_caches: list[Any] | None = None) -> tuple[Tensor, None]:
        last = self.model.norm(self.model.hidden_states(idx, kv_caches=kv_caches)[:, -1:])  # (B, 1, d_model)
        if self.output_weight_t is not None:
            return last @ self.output_weight_t, None  # (B, 1, V)
        return linear(last, self.output_weight), None
