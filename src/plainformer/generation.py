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

from typing import Any, Iterator, Protocol

import torch
from torch import Tensor

from . import _checks


class IncrementalDecoder(Protocol):
    block_size: int

    def new_kv_caches(self, batch_size: int) -> list[Any]: ...

    def __call__(self, idx: Tensor, *, kv_caches: list[Any] | None = None) -> tuple[Tensor, Any]: ...


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None:
        _checks.check_positive_int("top_k", top_k)
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def sample_next(logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """logits (B, V) -> next token ids (B,)."""
    _checks.check_tensor("logits", logits, ndim=2, shape_doc="(B, V)")
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        logits = _nucleus(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _nucleus(logits: Tensor, top_p: float) -> Tensor:
    """Keep the most likely tokens whose cumulative probability first reaches top_p (at least one)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before it >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def context_start(length: int, start: int, block_size: int) -> int:
    """First position of the context for predicting position `length` (see the module docstring)."""
    if length - start <= block_size:
        return start
    return length - max(1, block_size // 2)


def iter_generate(model: IncrementalDecoder, idx: Tensor, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  use_cache: bool = True, generator: torch.Generator | None = None,
                  eos_id: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield (next tokens (B,), their logits (B, V)) for each new position of prompts idx (B, n).

    With eos_id, a row that has produced it keeps producing it and the loop stops once every row has.
    """
    _checks.check_tensor("idx", idx, ndim=2, shape_doc="(B, n)")
    if idx.shape[1] == 0:
        raise ValueError("idx must hold at least one prompt token per row, got shape "
                         f"{tuple(idx.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
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
        next_tokens = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                  generator=generator)
        if eos_id is not None:
            next_tokens = next_tokens.masked_fill(finished, eos_id)
            finished |= next_tokens == eos_id
        tokens = torch.cat((tokens, next_tokens.unsqueeze(1)), dim=1)
        yield next_tokens, logits
        if eos_id is not None and bool(finished.all()):
            return


def generate(model: IncrementalDecoder, idx: Tensor, max_new_tokens: int, **options: Any) -> Tensor:
    """prompts idx (B, n) -> (B, n + new) with the tokens of `iter_generate` appended."""
    new = [tokens for tokens, _ in iter_generate(model, idx, max_new_tokens, **options)]
    if not new:
        return idx
    return torch.cat((idx, torch.stack(new, dim=1)), dim=1)


def length_penalty_factor(lengths: Tensor, alpha: float) -> Tensor:
    """lp(Y) = ((5 + |Y|) / 6)^α (Wu et al. 2016, GNMT); α = 0 ranks by log-probability alone."""
    return ((5.0 + lengths) / 6.0) ** alpha


def beam_search(model: IncrementalDecoder, idx: Tensor, max_new_tokens: int, *, beam_size: int = 4,
                length_penalty: float = 0.6, eos_id: int | None = None,
                use_cache: bool = True) -> tuple[Tensor, Tensor]:
    """The most likely continuation of each prompt idx (B, n) under beam search with length penalty.

    Each row keeps `beam_size` hypotheses Y ranked by s(Y) = log P(Y) / lp(Y) (`length_penalty_factor`,
    |Y| counting the generated tokens up to and including eos). At each step every hypothesis is
    extended by every token and the best beam_size of the beam_size · V candidates are kept. A
    hypothesis that produced eos stays in the beam as one candidate (extended by eos at no cost, its
    score unchanged) competing with the unfinished ones; a row is done when all its hypotheses are.
    The B · beam_size hypotheses run as one batch: row b · beam_size + j is beam j of prompt b, and
    the KV caches follow the surviving hypotheses via `reorder`.

    Returns (tokens (B, n + steps), scores (B,)): the best hypothesis of each row, eos-padded after its
    eos as `generate` pads, and its s(Y). beam_size = 1 is greedy decoding.
    """
    _checks.check_tensor("idx", idx, ndim=2, shape_doc="(B, n)")
    if idx.shape[1] == 0:
        raise ValueError(f"idx must hold at least one prompt token per row, got shape {tuple(idx.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    _checks.check_positive_int("beam_size", beam_size)
    if not isinstance(length_penalty, (int, float)) or length_penalty < 0:
        raise ValueError(f"length_penalty must be a number >= 0, got {length_penalty!r}")
    if idx.shape[1] + max_new_tokens - 1 > model.block_size:
        raise ValueError(f"beam search does not slide its context: {idx.shape[1]} prompt tokens + "
                         f"max_new_tokens={max_new_tokens} - 1 exceed block_size={model.block_size}")
    batch, k = idx.shape[0], beam_size
    tokens = idx.repeat_interleave(k, dim=0)  # (B·k, n)
    log_prob = torch.full((batch, k), float("-inf"), device=idx.device)
    log_prob[:, 0] = 0.0  # the k beams start as one hypothesis, the prompt
    lengths = torch.zeros(batch, k, device=idx.device)
    finished = torch.zeros(batch, k, dtype=torch.bool, device=idx.device)
    scores = log_prob.clone()
    caches = model.new_kv_caches(batch * k) if use_cache else None
    first_row = torch.arange(batch, device=idx.device).unsqueeze(1) * k  # (B, 1)
    cached_until = 0
    for _ in range(max_new_tokens):
        if use_cache:
            logits = model(tokens[:, cached_until:], kv_caches=caches)[0][:, -1]
            cached_until = tokens.shape[1]
        else:
            logits = model(tokens)[0][:, -1]
        step = torch.log_softmax(logits.float(), dim=-1).view(batch, k, -1)  # (B, k, V)
        if eos_id is not None:
            only_eos = torch.full_like(step[0, 0], float("-inf"))
            only_eos[eos_id] = 0.0
            step = torch.where(finished.unsqueeze(-1), only_eos, step)
        total = log_prob.unsqueeze(-1) + step  # (B, k, V) log P of every candidate
        new_lengths = lengths + (~finished).float()  # (B, k)
        candidate_scores = total / length_penalty_factor(new_lengths, length_penalty).unsqueeze(-1)
        scores, best = candidate_scores.view(batch, -1).topk(k, dim=-1)  # (B, k)
        parent, token = best // step.shape[-1], best % step.shape[-1]  # (B, k)
        log_prob = total.view(batch, -1).gather(1, best)
        lengths = new_lengths.gather(1, parent)
        finished = finished.gather(1, parent)
        if eos_id is not None:
            finished |= token == eos_id
        rows = (first_row + parent).flatten()  # (B·k,) surviving hypotheses
        tokens = torch.cat((tokens[rows], token.reshape(-1, 1)), dim=1)
        if caches is not None:
            for cache in caches:
                cache.reorder(rows)
        if bool(finished.all()):
            break
    top = scores.argmax(dim=-1)  # (B,)
    best_tokens = tokens.view(batch, k, -1)[torch.arange(batch, device=idx.device), top]
    return best_tokens, scores.gather(1, top.unsqueeze(1)).squeeze(1)
