"""Autoregressive decoding: one loop for every model that predicts the next token.

At each step the model reads the context and gives logits z (B, V) for the next token, which is
drawn from softmax(z / T), restricted to the k most likely tokens (top-k) and/or to the smallest set
whose probability reaches p (top-p, nucleus sampling). Temperature T = 0 takes argmax z (greedy).

With a KV cache only the newest token is fed at each step; the keys and values of earlier positions
are reused. The context holds at most `block_size` tokens: when it would grow past that, it slides,
keeping the last block_size // 2 tokens (the cache is refilled with them once, then grows again).
The cached and uncached paths slide identically, so they produce the same tokens.

Prompts of different lengths decode in one batch, left-padded (`pad_prompts`): each row keeps its own
context window, which the loop hands the model as an attention mask over the cached and new positions
(True = real token), so that every row decodes as it would alone. When a row's window slides, the
cache is refilled for the batch.

A model used here provides `block_size`, `new_kv_caches(batch_size)` and
`model(idx, kv_caches=caches) -> (logits (B, n, V), ...)`, where idx holds only the positions that
are not cached yet; for padded rows also `model(idx, kv_caches=..., attention_mask=(B, P + n))`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from .. import _checks
from .sampling import Generators, check_sampling, draw_next, raise_if_undefined
from .stopping import StopStrings


class IncrementalDecoder(Protocol):
    block_size: int

    def new_kv_caches(self, batch_size: int) -> list[Any]: ...

    def __call__(self, idx: Tensor, *, kv_caches: list[Any] | None = None,
                 attention_mask: Tensor | None = None) -> tuple[Tensor, Any]: ...


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


def pad_prompts(prompts: Sequence[Sequence[int] | Tensor], pad_id: int = 0,
                device: torch.device | None = None) -> tuple[Tensor, list[int]]:
    """Prompts of token ids (lists or 1-D tensors, each at least one token) -> (idx (B, n_max) with each
    prompt at the right end of its row, the number of padding positions before each)."""
    if isinstance(prompts, (str, Tensor)) or not isinstance(prompts, Sequence) or not prompts:
        raise TypeError("prompts must be a non-empty list of token-id lists or 1-D tensors, "
                        f"got {type(prompts).__name__}")
    rows = []
    for i, prompt in enumerate(prompts):
        row = prompt.tolist() if isinstance(prompt, Tensor) and prompt.dim() == 1 else prompt
        if isinstance(row, Tensor) or not isinstance(row, Sequence) or not all(_checks.is_int(t) for t in row):
            raise TypeError(f"prompts[{i}] must be a list of token ids or a 1-D tensor of them")
        if not row:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        rows.append(list(row))
    width = max(len(row) for row in rows)
    pads = [width - len(row) for row in rows]
    padded = [[pad_id] * pad + row for pad, row in zip(pads, rows, strict=True)]
    return torch.tensor(padded, dtype=torch.long, device=device), pads


def _windows_mask(firsts: list[int], begin: int, end: int, device: torch.device) -> Tensor | None:
    """(B, end - begin) True where each row's window (from firsts[b]) covers tokens[:, begin:end]; None
    when every row's window is the whole span."""
    if all(first == begin for first in firsts):
        return None
    columns = torch.arange(begin, end, device=device)
    return columns[None, :] >= torch.tensor(firsts, device=device)[:, None]


def iter_generate(model: IncrementalDecoder, idx: Tensor, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  use_cache: bool = True, generator: Generators = None, eos_id: int | None = None,
                  pads: Sequence[int] | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield (next tokens (B,), their logits (B, V)) for each new position of prompts idx (B, n).

    pads: the padding positions before each row's prompt (`pad_prompts`); each row then decodes as
    its prompt would alone (with a generator per row, sampling too). With eos_id, a row that has
    produced it keeps producing it and the loop stops once every row has.
    """
    check_prompts(idx, max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    pads = _checked_pads(pads, idx)
    if isinstance(generator, Sequence) and len(generator) != idx.shape[0]:
        raise ValueError(f"generator: one per row takes {idx.shape[0]} generators, got {len(generator)}")
    block_size = model.block_size
    tokens = idx
    starts = [max(0, idx.shape[1] - pad - block_size) for pad in pads]  # of each row's prompt alone
    caches, cached_starts, cached_from, cached_until = None, None, 0, 0
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        length = tokens.shape[1]
        starts = [context_start(length - pad, start, block_size) for pad, start in zip(pads, starts, strict=True)]
        firsts = [pad + start for pad, start in zip(pads, starts, strict=True)]  # each window's first index in tokens
        if use_cache:
            if cached_starts != starts:
                caches, cached_starts = model.new_kv_caches(idx.shape[0]), starts
                cached_from = cached_until = min(firsts)
            mask = _windows_mask(firsts, cached_from, length, idx.device)
            logits = _next_logits(model, tokens[:, cached_until:length], caches, mask)
            cached_until = length
        else:
            mask = _windows_mask(firsts, min(firsts), length, idx.device)
            logits = _next_logits(model, tokens[:, min(firsts):length], None, mask)
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


def _next_logits(model: IncrementalDecoder, idx: Tensor, caches: list[Any] | None, mask: Tensor | None) -> Tensor:
    """The logits (B, V) after idx; the attention mask only when rows are padded, so that a model
    without padded rows need not take one."""
    if mask is None:
        return model(idx, kv_caches=caches)[0][:, -1]
    return model(idx, kv_caches=caches, attention_mask=mask)[0][:, -1]


def _checked_pads(pads: Sequence[int] | None, idx: Tensor) -> list[int]:
    if pads is None:
        return [0] * idx.shape[0]
    if len(pads) != idx.shape[0] or not all(_checks.is_int(p) and 0 <= p < idx.shape[1] for p in pads):
        raise ValueError(f"pads must give each of the {idx.shape[0]} rows its padding positions, each in "
                         f"[0, {idx.shape[1]}) so that a prompt keeps a token, got {list(pads)}")
    return list(pads)


def generate(model: IncrementalDecoder, idx: Tensor, max_new_tokens: int, **options: Any) -> Tensor:
    """prompts idx (B, n) -> (B, n + new) with the tokens of `iter_generate` appended."""
    new = [tokens for tokens, _ in iter_generate(model, idx, max_new_tokens, **options)]
    if not new:
        return idx
    return torch.cat((idx, torch.stack(new, dim=1)), dim=1)


def generate_prompts(model: IncrementalDecoder, prompts: Sequence[Sequence[int] | Tensor], max_new_tokens: int, *,
                     eos_id: int | None = None, stop: StopStrings | None = None, pad_id: int = 0,
                     device: torch.device | None = None, **options: Any) -> list[list[int]]:
    """Prompts of different lengths decoded in one batch -> each prompt's tokens with its new ones,
    which end after eos_id or after the token that completes a stop string (whichever comes first).
    `options` are `iter_generate`'s. Stop strings are read from the text after every token (one host
    copy per token); without them the tokens are read once, at the end."""
    idx, pads = pad_prompts(prompts, pad_id, device=device)
    return generate_padded(model, idx, pads, max_new_tokens, eos_id=eos_id, stop=stop, **options)


def generate_padded(model: IncrementalDecoder, idx: Tensor, pads: list[int], max_new_tokens: int, *,
                    eos_id: int | None = None, stop: StopStrings | None = None, **options: Any) -> list[list[int]]:
    """`generate_prompts` of prompts already padded by `pad_prompts` (idx (B, n), pads)."""
    rows = idx.shape[0]
    steps = iter_generate(model, idx, max_new_tokens, eos_id=eos_id, pads=pads, **options)
    new = _until_stopped(steps, rows, eos_id, stop) if stop else _until_eos(steps, rows, eos_id)
    return [row[pad:] + tokens for row, pad, tokens in zip(idx.tolist(), pads, new, strict=True)]


def _until_eos(steps: Iterator[tuple[Tensor, Tensor]], rows: int, eos_id: int | None) -> list[list[int]]:
    drawn = [tokens for tokens, _ in steps]
    if not drawn:
        return [[] for _ in range(rows)]
    return [_through(row, eos_id) for row in torch.stack(drawn, dim=1).tolist()]


def _through(tokens: list[int], eos_id: int | None) -> list[int]:
    """`tokens` up to and including the first eos_id."""
    return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def _until_stopped(steps: Iterator[tuple[Tensor, Tensor]], rows: int, eos_id: int | None,
                   stop: StopStrings) -> list[list[int]]:
    new: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for tokens, _ in steps:
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                new[row].append(token)
                done[row] = token == eos_id or stop.cut(stop.decode(new[row])) is not None
        if all(done):
            break
    return new
