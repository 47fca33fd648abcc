"""Autoregressive decoding: one loop for every model that predicts the next token.

At each step the model reads the context and gives logits z (B, V) for the next token, which is
drawn from softmax(z / T), restricted to the k most likely tokens (top-k) and/or to the smallest set
whose probability reaches p (top-p, nucleus sampling). Temperature T = 0 takes argmax z (greedy).

With a KV cache only the newest token is fed at each step; the keys and values of earlier positions
are reused. The context holds at most `block_size` tokens: when it would grow past that, it slides,
keeping the last block_size // 2 tokens (the cache is refilled with them once, then grows again).
The cached and uncached paths slide identically, so they produce the same tokens.

A model used here provides `block_size`, `new_kv_caches(batch_size)` and
`model(idx, kv_caches=caches) -> (logits (B, n, V), ...)`, where idx holds only the positions that
are not cached yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from .. import _checks
from .sampling import check_sampling, draw_next, raise_if_undefined


class IncrementalDecoder(Protocol):
    block_size: int

    def new_kv_caches(self, batch_size: int) -> list[Any]: ...

    def __call__(self, idx: Tensor, *, kv_caches: list[Any] | None = None) -> tuple[Tensor, Any]: ...


def context_start(length: int, start: int, block_size: int) -> int:
    """First position of the context for predicting position `length` (see the module docstring)."""
    if length - start <= block_size:
        return start
    return length - max(1, block_size // 2)


def check_prompts(idx: Tensor, max_new_tokens: int) -> None:
    """Prompts idx (B, n), n >= 1, to extend by max_new_tokens >= 0 (the loops' shared arguments)."""
    _checks.check_tensor("idx", idx, ndim=2, shape_doc="(B, n)")
    if idx.shape[1] == 0:
        raise ValueError(f"idx must hold at least one prompt token per row, got shape {tuple(idx.shape)}")
    _checks.check_non_negative_int("max_new_tokens", max_new_tokens)


def iter_generate(model: IncrementalDecoder, idx: Tensor, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  use_cache: bool = True, generator: torch.Generator | None = None,
                  eos_id: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield (next tokens (B,), their logits (B, V)) for each new position of prompts idx (B, n).

    With eos_id, a row that has produced it keeps producing it and the loop stops once every row has.
    """
    check_prompts(idx, max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    block_size = model.block_size
    tokens = idx
    start = max(0, idx.shape[1] - block_size)
    caches, cached_start, cached_until = None, -1, 0
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        length = tokens.shape[1]
        start = context_start(length, start, block_size)
        if use_cache:
            if cached_start != start:
                caches, cached_start, cached_until = model.new_kv_caches(idx.shape[0]), start, start
            logits = model(tokens[:, cached_until:length], kv_caches=caches)[0][:, -1]
            cached_until = length
        else:
            logits = model(tokens[:, start:length])[0][:, -1]
        next_tokens, undefined = draw_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                           generator=generator)
        if eos_id is None:
            raise_if_undefined(undefined)
        else:
            next_tokens = next_tokens.masked_fill(finished, eos_id)
            finished |= next_tokens == eos_id
            if undefined is None:
                all_finished = bool(finished.all())
            else:  # one host read per token for both questions: a row without a distribution, all done
                any_undefined, all_finished = torch.stack((undefined.any(), finished.all())).tolist()
                if any_undefined:
                    raise_if_undefined(undefined)
        tokens = torch.cat((tokens, next_tokens.unsqueeze(1)), dim=1)
        yield next_tokens, logits
        if eos_id is not None and all_finished:
            return


def generate(model: IncrementalDecoder, idx: Tensor, max_new_tokens: int, **options: Any) -> Tensor:
    """prompts idx (B, n) -> (B, n + new) with the tokens of `iter_generate` appended."""
    new = [tokens for tokens, _ in iter_generate(model, idx, max_new_tokens, **options)]
    if not new:
        return idx
    return torch.cat((idx, torch.stack(new, dim=1)), dim=1)
