"""Beam search with the GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^α (Wu et al. 2016).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks
from ..nn.dtypes import at_least_float32
from .decoding import IncrementalDecoder, check_prompts


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
    the KV caches follow the surviving hypotheses via `reorder(rows, group_size=beam_size)`.

    Returns (tokens (B, n + steps), scores (B,)): the best hypothesis of each row, eos-padded after its
    eos as `generate` pads, and its s(Y). beam_size = 1 is greedy decoding.
    """
    check_prompts(idx, max_new_tokens)
    _checks.check_positive_int("beam_size", beam_size)
    _checks.check_non_negative_number("length_penalty", length_penalty)
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
        step = torch.log_softmax(at_least_float32(logits), dim=-1).view(batch, k, -1)  # (B, k, V)
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
                cache.reorder(rows, group_size=k)  # every row stays among its prompt's k beams
        if bool(finished.all()):
            break
    top = scores.argmax(dim=-1)  # (B,)
    best_tokens = tokens.view(batch, k, -1)[torch.arange(batch, device=idx.device), top]
    return best_tokens, scores.gather(1, top.unsqueeze(1)).squeeze(1)
