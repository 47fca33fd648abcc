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
    score unchanged) competing with the unfinished ones; a row is done when all its hypotheses are, and
    leaves the batch then: nothing could change its result, so the steps after it cost only the rows left.
    The hypotheses run as one batch: row b · beam_size + j is beam j of prompt b, and the KV caches follow
    the surviving hypotheses via `reorder(rows, group_size=beam_size)`; a model with `keep_sources(rows)`
    (a decoder bound to sources) is told which prompts are left.

    Returns (tokens (B, n + steps), scores (B,)): the best hypothesis of each row, eos-padded after its
    eos as `generate` pads, and its s(Y). beam_size = 1 is greedy decoding.
    """
    check_prompts(idx, max_new_tokens)
    _checks.check_positive_int("beam_size", beam_size)
    _checks.check_non_negative_number("length_penalty", length_penalty)
    if idx.shape[1] + max_new_tokens - 1 > model.block_size:
        raise ValueError(f"beam search does not slide its context: {idx.shape[1]} prompt tokens + "
                         f"max_new_tokens={max_new_tokens} - 1 exceed block_size={model.block_size}")
    search = _Beams(model, idx, beam_size, length_penalty, eos_id, use_cache)
    for _ in range(max_new_tokens):
        if search.step():
            break
    return search.results()


class _Beams:
    """The state of `beam_search` over the prompts still decoding (`live`, their indices in the batch)."""

    def __init__(self, model: IncrementalDecoder, idx: Tensor, k: int, alpha: float, eos_id: int | None,
                 use_cache: bool):
        self.model, self.k, self.alpha, self.eos_id = model, k, alpha, eos_id
        batch, device = idx.shape[0], idx.device
        self.tokens = idx.repeat_interleave(k, dim=0)  # (B·k, n)
        self.log_prob = torch.full((batch, k), float("-inf"), device=device)
        self.log_prob[:, 0] = 0.0  # the k beams start as one hypothesis, the prompt
        self.lengths = torch.zeros(batch, k, device=device)
        self.finished = torch.zeros(batch, k, dtype=torch.bool, device=device)
        self.scores = self.log_prob.clone()
        self.caches = model.new_kv_caches(batch * k) if use_cache else None
        self.cached_until = 0
        self.live = torch.arange(batch, device=device)
        self.done: list[tuple[Tensor, Tensor, Tensor]] = []  # (prompt indices, best tokens, their scores)

    def step(self) -> bool:
        """Extend every live hypothesis by one token; returns whether every prompt is done."""
        batch, k = self.log_prob.shape
        if self.caches is not None:
            logits = self.model(self.tokens[:, self.cached_until:], kv_caches=self.caches)[0][:, -1]
            self.cached_until = self.tokens.shape[1]
        else:
            logits = self.model(self.tokens)[0][:, -1]
        step = torch.log_softmax(at_least_float32(logits), dim=-1).view(batch, k, -1)  # (B, k, V)
        if self.eos_id is not None:
            only_eos = torch.full_like(step[0, 0], float("-inf"))
            only_eos[self.eos_id] = 0.0
            step = torch.where(self.finished.unsqueeze(-1), only_eos, step)
        total = self.log_prob.unsqueeze(-1) + step  # (B, k, V) log P of every candidate
        new_lengths = self.lengths + (~self.finished).float()  # (B, k)
        candidate_scores = total / length_penalty_factor(new_lengths, self.alpha).unsqueeze(-1)
        self.scores, best = candidate_scores.view(batch, -1).topk(k, dim=-1)  # (B, k)
        parent, token = best // step.shape[-1], best % step.shape[-1]  # (B, k)
        self.log_prob = total.view(batch, -1).gather(1, best)
        self.lengths = new_lengths.gather(1, parent)
        self.finished = self.finished.gather(1, parent)
        if self.eos_id is not None:
            self.finished |= token == self.eos_id
        first_row = torch.arange(batch, device=token.device).unsqueeze(1) * k  # (B, 1)
        rows = (first_row + parent).flatten()  # (B·k,) surviving hypotheses
        self.tokens = torch.cat((self.tokens[rows], token.reshape(-1, 1)), dim=1)
        if self.caches is not None:
            for cache in self.caches:
                cache.reorder(rows, group_size=k)  # every row stays among its prompt's k beams
        return self._retire(self.finished.all(dim=1))

    def _retire(self, done: Tensor) -> bool:
        """Set aside the prompts whose hypotheses all ended; returns whether none is left."""
        if not bool(done.any()):
            return False
        self.done.append(self._best(done))
        if bool(done.all()):
            self.live = self.live[:0]
            return True
        keep = (~done).nonzero().squeeze(1)  # (B',) the prompts left, in order
        rows = (keep.unsqueeze(1) * self.k + torch.arange(self.k, device=keep.device)).flatten()  # their beams
        self.tokens, self.live = self.tokens[rows], self.live[keep]
        self.log_prob, self.lengths = self.log_prob[keep], self.lengths[keep]
        self.finished, self.scores = self.finished[keep], self.scores[keep]
        if self.caches is not None:
            for cache in self.caches:
                cache.reorder(rows, whole_groups=self.k)
        keep_sources = getattr(self.model, "keep_sources", None)
        if keep_sources is not None:
            keep_sources(keep)
        return False

    def _best(self, prompts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(their indices in the batch, best tokens (P, n + steps so far), scores (P,)) of the live `prompts` mask."""
        top = self.scores[prompts].argmax(dim=-1)  # (P,)
        tokens = self.tokens.view(len(self.live), self.k, -1)[prompts]  # (P, k, length)
        chosen = tokens[torch.arange(len(top), device=top.device), top]
        return self.live[prompts], chosen, self.scores[prompts].gather(1, top.unsqueeze(1)).squeeze(1)

    def results(self) -> tuple[Tensor, Tensor]:
        """The best hypothesis of every prompt, in the batch's order, eos-padded to the longest, and its score."""
        if len(self.live):  # max_new_tokens reached before they ended
            self.done.append(self._best(torch.ones(len(self.live), dtype=torch.bool, device=self.live.device)))
        width = max(tokens.shape[1] for _, tokens, _ in self.done)
        batch = sum(len(prompts) for prompts, _, _ in self.done)
        pad = self.eos_id if self.eos_id is not None else 0
        out = self.done[0][1].new_full((batch, width), pad)
        scores = self.done[0][2].new_empty(batch)
        for prompts, tokens, best in self.done:
            out[prompts, :tokens.shape[1]] = tokens
            scores[prompts] = best
        return out, scores
