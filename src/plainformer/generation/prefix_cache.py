"""A prefix cache: the keys and values of prompts prefilled before, so that a prompt that begins as one of
them computes only what follows (as vLLM's automatic prefix caching and llama.cpp's cached prompts).

One entry per whole prompt: its tokens and, for every layer, the keys and values (H_kv, p, d_k) of its p
positions, kept in the order of use. A new prompt reuses the longest prefix any entry shares with it, but
never its own last token, whose logits draw the first new token and must be computed. Whole prompts rather
than fixed blocks keep it simple: a lookup is one comparison per entry (a binary search on list slices),
and the chat prompts that share a system prompt, and lm-eval's continuations of one context, each differ
from an entry only past the shared part. What that costs is memory: two prompts that share a prefix hold
it twice, except that a prompt extending an entry (the next turn of a chat) replaces it.

Reuse is exact: the keys and values of positions 0 .. m-1 depend on tokens 0 .. m-1 only (causal attention;
rotary and learned positions count from the row's first token; ALiBi enters the scores, not the keys;
token shift and bigram read the previous token, prompt[m-1], which the batcher writes as the cache's newest
token). They differ from a fresh prefill's by the float rounding of another batch shape only.

A prompt whose scores are asked (prompt_logprobs, what lm-eval's loglikelihood sends) needs the
log-probabilities at the reused positions too: an entry that was scored keeps them with its top k
alternatives (float64 and int64 tensors), and serves prompts that ask at most k of them, reusing one
position less than it shares (the logits of the last reused position must be computed: the token after it
is another).

Bounded by `capacity` bytes (keys, values and scores); the least recently used entries leave first. A model
with a sliding window keeps only its last w positions, out of which no shorter prefix can be cut: the
batcher keeps no prefix cache for it.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch
from torch import Tensor

from .. import _checks
from ..memory import device_available

#: The default capacity: this fraction of the memory available once the model is loaded, at most MAX_DEFAULT.
DEFAULT_FRACTION, MAX_DEFAULT = 1 / 8, 4 * 2**30


@dataclasses.dataclass(eq=False)
class Prefix:
    """A cached prompt: tokens (p,), keys and values per layer (H_kv, p, d_k), and, when it was scored,
    logprobs (p-1,) float64 (of tokens 1 .. p-1) and the top_k alternatives at each, ids (p-1, top_k) and
    their log-probabilities (p-1, top_k); top_k -1: not scored."""

    tokens: list[int]
    keys: list[Tensor]
    values: list[Tensor]
    logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    top_logprobs: Tensor | None = None

    @property
    def top_k(self) -> int:
        return -1 if self.top_ids is None else self.top_ids.shape[1]

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, self.logprobs, self.top_ids, self.top_logprobs]
        return sum(t.nbytes for t in tensors if t is not None)

    def scores(self, m: int, k: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """The log-probabilities of tokens 1 .. m and their k most likely alternatives (an entry scored)."""
        assert self.logprobs is not None and self.top_ids is not None and self.top_logprobs is not None
        ids, values = self.top_ids[:m, :k].tolist(), self.top_logprobs[:m, :k].tolist()
        return self.logprobs[:m].tolist(), [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]


class PrefixCache:
    """Prompts' keys and values, at most `capacity` bytes of them, least recently used evicted first."""

    def __init__(self, capacity: int):
        _checks.check_positive_int("capacity", capacity)
        self.capacity = capacity
        self._entries: OrderedDict[int, Prefix] = OrderedDict()  # by id(entry), least recently used first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: list[int], scored: int | None) -> tuple[Prefix, int] | None:
        """The entry that gives `prompt` the longest reusable prefix, and that prefix's length m (at most
        len(prompt) - 1; with `scored` alternatives asked, an entry scored with as many, and one less than
        shared); None when no entry gives one. The entry becomes the most recently used."""
        best: tuple[Prefix, int] | None = None
        for entry in reversed(self._entries.values()):
            if scored is not None and entry.top_k < scored:
                continue
            shared = _common_length(entry.tokens, prompt)
            m = min(shared - (scored is not None), len(prompt) - 1)
            if m > 0 and (best is None or m > best[1]):
                best = (entry, m)
        if best is not None:
            self._entries.move_to_end(id(best[0]))
        return best

    def holds(self, prompt: list[int], scored: int | None) -> bool:
        """Whether an entry begins with all of `prompt` (scored with as many alternatives, if asked): adding
        it would add nothing."""
        return any(len(entry.tokens) >= len(prompt) and entry.tokens[:len(prompt)] == prompt
                   and (scored is None or entry.top_k >= scored) for entry in self._entries.values())

    def add(self, entry: Prefix) -> None:
        """Keep `entry` as the most recently used, in place of the entries it extends (those whose tokens
        begin it and that were scored with no more alternatives), evicting the least recently used ones
        while the bytes exceed the capacity; an entry larger than the capacity is not kept."""
        size = entry.nbytes
        if size > self.capacity:
            return
        for key, old in list(self._entries.items()):
            if (len(old.tokens) <= len(entry.tokens) and entry.tokens[:len(old.tokens)] == old.tokens
                    and old.top_k <= entry.top_k):
                self._drop(key)
        while self.nbytes + size > self.capacity:
            self._drop(next(iter(self._entries)))
        self._entries[id(entry)] = entry
        self.nbytes += size

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes


def _common_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share: a binary search on slices (each compared in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def default_capacity(device: torch.device) -> int:
    """Bytes for a prefix cache on `device`: DEFAULT_FRACTION of its free memory (an accelerator's) or of the
    memory available (the CPU's), at most MAX_DEFAULT, at least 1."""
    return max(1, min(int(device_available(device) * DEFAULT_FRACTION), MAX_DEFAULT))
