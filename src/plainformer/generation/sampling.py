"""Drawing the next token from logits z (B, V): softmax(z / T), restricted to the k most likely
tokens (top-k) and/or to the smallest set whose probability reaches p (top-p, nucleus sampling).
Temperature T = 0 takes argmax z (greedy); any T > 0 the checks accept decodes, however small, since
the scaling is done on z - max z.

Seeds: a row's seed is derived from a request's by an offset (`derived_seed`), wrapping at 2**64, the
range `torch.Generator.manual_seed` takes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _checks

#: One generator for the batch, or one per row (a row then draws what it would alone).
Generators = torch.Generator | Sequence[torch.Generator] | None


_FLOAT32_TINY = torch.finfo(torch.float32).tiny


def derived_seed(seed: int, offset: int) -> int:
    """The seed of row `offset` of a batch seeded with `seed`: seed + offset, wrapped into [0, 2**64), so
    that seed 2**64 - 1 with two samples gives 2**64 - 1 and 0 rather than an overflow."""
    return (seed + offset) % _checks.SEED_RANGE


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not _checks.is_non_negative_number(temperature):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy) and finite, got {temperature!r}")
    if top_k is not None:
        _checks.check_positive_int("top_k", top_k)
    if top_p is not None and not _checks.is_mass(top_p):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def sample_next(logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """logits (B, V) -> next token ids (B,).

    A row to sample from must hold a finite logit and no NaN or +inf (its softmax is undefined
    otherwise); else ValueError. The check costs one device-to-host copy, as torch.multinomial's own
    check of its probabilities does, and spares a CUDA device-side assert.
    """
    _checks.check_tensor("logits", logits, ndim=2, shape_doc="(B, V)")
    check_sampling(temperature, top_k, top_p)
    tokens, undefined = draw_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                  generator=generator)
    raise_if_undefined(undefined)
    return tokens


def draw_next(logits: Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
              generator: Generators) -> tuple[Tensor, Tensor | None]:
    """`sample_next` without its check and its host sync, for the decoding loop, which reads the
    returned flags (B,) bool, True where a row had no distribution, together with its own; None
    for greedy decoding (argmax needs no distribution, and so no sync). Arguments are checked by
    the caller."""
    if temperature == 0:
        return logits.argmax(dim=-1), None
    logits = logits.float()
    undefined = (logits.isnan() | (logits == math.inf)).any(-1) | (logits == -math.inf).all(-1)  # (B,)
    logits = _scaled(logits, temperature)
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        logits = _nucleus(logits, top_p)
    return _categorical(torch.softmax(logits, dim=-1), generator), undefined


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """(z - max z) / T, row by row (B, V): softmax's argument at temperature T, shifted so that it never
    overflows. z / T itself reaches +inf once T is small enough (z = 10, T = 1e-38), and its softmax is
    then NaN; the shifted row has its largest entry at 0 and the others at or towards -inf, so a tiny T
    draws among the most likely tokens, as the limit T -> 0 (greedy) does. softmax is unchanged by the
    shift. A T below float32's smallest normal number (1e-300, say) would round to 0 in float32, so the
    division is done in float64 then; the quotients that float32 cannot hold become -inf, as they should."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    if temperature < _FLOAT32_TINY:
        return (shifted.double() / temperature).float()
    return shifted / temperature


def raise_if_undefined(undefined: Tensor | None) -> None:
    """ValueError naming the rows flagged by `draw_next` (one host read unless None)."""
    if undefined is not None and undefined.any():
        raise _undefined_rows(undefined)


def _undefined_rows(undefined: Tensor) -> ValueError:
    rows = undefined.nonzero().flatten().tolist()
    return ValueError(f"logits rows {rows[:5]} hold NaN or +inf, or only -inf: there is no "
                      "distribution to sample from")


def _categorical(probs: Tensor, generator: Generators) -> Tensor:
    """One draw per row of probs (B, V): argmax_i p_i / E_i with E_i ~ Exp(1) independent.

    E_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is the j-th with probability
    p_j / Σ p (the exponential race), so this is a categorical draw. Why not torch.multinomial: it
    validates its input with host syncs on every call, a stall per token on a GPU. Tokens with p = 0
    never win (their ratio is set to 0 rather than 0 / E). With a generator per row, row b's E come
    from generators[b], as they would for that row alone.
    """
    if isinstance(generator, Sequence):
        race = torch.stack([torch.empty_like(row).exponential_(generator=own)
                            for row, own in zip(probs, generator, strict=True)])
    else:
        race = torch.empty_like(probs).exponential_(generator=generator)
    return torch.where(probs > 0, probs / race, 0.0).argmax(dim=-1)


def _nucleus(logits: Tensor, top_p: float) -> Tensor:
    """Keep the most likely tokens whose cumulative probability first reaches top_p (at least one)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before it >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
