"""Attention masks: which of the m keys each of the n queries may see, combined once per batch.

Masks follow `torch.nn.functional.scaled_dot_product_attention`: a boolean mask is True where a query
may attend a key, a float mask is added to the scores, and either broadcasts to the scores
(B, h, n, m). These constraints and biases meet here:

    causal         query i sees keys j <= i + P (P = positions already in a KV cache; P = 0 is
                   torch's top-left convention)
    key padding    (B, m) boolean, True = real token: a padded key is seen by no query
    attn_mask      any boolean or additive mask broadcastable to (B, h, n, m)
    window         query i sees only the last w keys: j > i + P - w (Mistral's sliding_window: key j is
                   visible to query i iff i - w < j <= i)
    ALiBi          head h's score of query i for key j gets -m_h · (i + P - j) (Press et al. 2022;
                   `positional.alibi_slopes`)

A stack builds one `AttentionMask` per forward and hands it to every layer, so the masks are
combined once, not once per layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import _checks
from .positional import alibi_bias


def causal_mask(n: int, m: int, *, offset: int = 0, device: torch.device | str | None = None) -> Tensor:
    """Boolean (n, m) mask, True where query i may attend key j, i.e. j <= i + offset.

    offset = 0 is torch's top-left convention; offset = m - n aligns the last query with the last key,
    which is what decoding with a KV cache of m - n past positions needs.
    """
    _checks.check_positive_int("n", n)
    _checks.check_positive_int("m", m)
    rows = torch.arange(n, device=device).unsqueeze(1)
    cols = torch.arange(m, device=device).unsqueeze(0)
    return cols <= rows + offset


def and_masks(mask: Tensor | None, allowed: Tensor) -> Tensor:
    """Restrict `mask` (boolean, additive or None) to the positions where boolean `allowed` is True."""
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """The constraints on one batch's attention scores, in the forms the backends take.

    is_causal    causal masking (query i sees keys j <= i + offset) on top of the other constraints;
                 torch's sdpa applies it without a mask tensor where offset = 0, our flash kernel at any
                 offset.
    key_padding  (B, m) boolean, True = real token, or None; the only mask tensor flash attention takes.
    attn_mask    any other constraint, broadcastable to (B, h, n, m) (the user's mask), or None.
    dense        all of them in one mask broadcastable to (B, h, n, m), or None when nothing is
                 masked: what the step-by-step math path and sdpa (with more than causality) read.
                 An ALiBi bias makes it additive.
    offset       query i sits at key position i + offset (the P cached keys before it).
    window       w: query i sees only keys j > i + offset - w; None when that hides no key.
    alibi        ALiBi's slopes m_h (h,), or None: scores get -m_h · (i + offset - j).
    """

    is_causal: bool = False
    key_padding: Tensor | None = None
    attn_mask: Tensor | None = None
    dense: Tensor | None = None
    offset: int = 0
    window: int | None = None
    alibi: Tensor | None = None
    # `additive_for`'s masks by dtype: made once per batch, not once per layer
    _additive: dict[torch.dtype, Tensor] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                             compare=False)

    @classmethod
    def build(cls, n: int, m: int, *, is_causal: bool = False, cached: int = 0,
              key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None,
              window: int | None = None, alibi: Tensor | None = None,
              device: torch.device | None = None) -> AttentionMask:
        """Combine the constraints for n queries at positions cached .. cached+n-1 over m keys at
        positions 0 .. m-1.

        key_padding_mask (B, m) and attn_mask (broadcastable to (B, h, n, m)) are taken as given:
        validate them at the public boundary first (`check_masks`). window: each query sees the last
        `window` positions (itself included). alibi: the slopes (h,).
        """
        if is_causal and cached >= m - 1:  # every query sees every key: nothing to mask
            is_causal = False
        if window is not None and n - 1 + cached < window:  # the last query's window reaches key 0
            window = None
        dense = attn_mask
        if alibi is not None:
            bias = alibi_bias(alibi, torch.arange(cached, cached + n, device=device)[None],
                              torch.arange(m, device=device)[None])  # (1, h, n, m)
            dense = bias if dense is None else bias + _additive(dense, bias.dtype)
        if key_padding_mask is not None:
            dense = and_masks(dense, key_padding_mask[:, None, None, :])  # (B, 1, 1, m)
        if is_causal:
            dense = and_masks(dense, causal_mask(n, m, offset=cached, device=device))
        if window is not None:
            dense = and_masks(dense, ~causal_mask(n, m, offset=cached - window, device=device))  # j > i + P - w
        return cls(is_causal, key_padding_mask, attn_mask, dense, cached, window, alibi)

    @classmethod
    def causal(cls, n: int, m: int, *, device: torch.device | None = None) -> AttentionMask:
        """n queries at the last n of m positions, query i seeing key j iff j <= i + m - n: a decoder's
        self-attention over the m - n positions cached before the queries (`build` with is_causal and
        cached = m - n)."""
        cached = m - n
        if cached >= m - 1:  # one query, the newest: it sees every key
            return cls(offset=cached)
        return cls(True, dense=causal_mask(n, m, offset=cached, device=device), offset=cached)

    @property
    def only_causal(self) -> bool:
        """Nothing but (at most) the top-left causal mask: backends need no mask tensor."""
        return (self.key_padding is None and self.attn_mask is None and self.window is None and self.alibi is None
                and (not self.is_causal or self.offset == 0))

    @property
    def rows_see_a_key(self) -> bool:
        """Every query sees at least one key, so a plain softmax needs no guard against all -inf rows.

        Causality alone leaves key 0 to every query, and ALiBi only biases. A window leaves query i the keys
        j in (i + P - w, i + P], none past m - 1: the last query's range is empty only if P + n - w >= m,
        never in self-attention (m = P + n). A padding mask or the user's mask may hide a whole row.
        """
        if self.key_padding is not None or self.attn_mask is not None:
            return False
        if self.window is None or self.dense is None:
            return True
        n, m = self.dense.shape[-2:]
        return self.offset + n < m + self.window

    def dense_for(self, dtype: torch.dtype) -> Tensor | None:
        """`dense` with an additive mask in the scores' dtype (boolean masks are kept)."""
        if self.dense is None or self.dense.dtype == torch.bool:
            return self.dense
        return self.additive_for(dtype)

    def additive_for(self, dtype: torch.dtype) -> Tensor | None:
        """`dense` as an additive mask in `dtype`: 0 (or the bias) where a query may attend, -inf where not."""
        if self.dense is None:
            return None
        if dtype not in self._additive:
            self._additive[dtype] = _additive(self.dense, dtype)
        return self._additive[dtype]


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask as 0 / -inf in `dtype`; an additive one in `dtype`."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


NO_MASK = AttentionMask()


def check_masks(batch: int, heads: int, n: int, m: int, device: torch.device, *,
                attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
                mask_name: str = "mask", key_padding_name: str = "key_padding_mask") -> Tensor | None:
    """Validate a layer's masks at the public boundary; returns attn_mask as (B|1, h|1, n, m).

    attn_mask: boolean (True = may attend) or additive float, (n, m), (B, n, m) or (B, h, n, m).
    key_padding_mask: (B, m) boolean, True = real token. Shapes and dtypes only: nothing is read.
    """
    if attn_mask is not None:
        _checks.check_tensor(mask_name, attn_mask, ndim=(2, 3, 4),
                             shape_doc="(n, m), (B, n, m) or (B, h, n, m)")
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)  # (B, 1, n, m)
        check_mask_tensor(mask_name, attn_mask, (batch, heads, n, m), device, "(B, h, n, m)")
    if key_padding_mask is not None:
        _checks.check_key_padding_mask(key_padding_name, key_padding_mask, batch, m, device)
    return attn_mask


def check_mask_tensor(name: str, mask: Tensor, scores_shape: tuple[int, ...], device: torch.device,
                      scores_doc: str = "(..., n, m)") -> None:
    """A boolean or additive mask broadcastable to scores of shape `scores_shape`, on `device`."""
    _checks.check_tensor(name, mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be boolean (True = may attend) or an additive float mask, "
                        f"got dtype {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the inputs are on {device}")
    _checks.check_broadcastable(name, mask, scores_shape, scores_doc)
    if mask.dim() > len(scores_shape):
        raise ValueError(f"{name} has {mask.dim()} dimensions, more than the scores {scores_doc} "
                         f"of shape {scores_shape}")


def padded_positions(real: Tensor, cached: int = 0, *, keys: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A batch of padded rows: real (B, P + n) boolean, True = real token, over the P = `cached` positions
    before the n queries and the queries -> (the queries' positions (B, n), the positions of the last `keys`
    of them (B, m) (default all P + n: a cache that keeps only a window's keys attends fewer), the keys
    each query may see (B, 1, n, m)).

    A query's position counts the real tokens before it in its row, so each row is positioned as if
    alone. No query sees a padding key, except that a padding query sees itself: a row of scores with
    no key would be NaN, and its NaN values would reach the real queries of the next layer as 0 · NaN.
    """
    n = real.shape[1] - cached
    m = real.shape[1] if keys is None else keys
    key_positions = (real.cumsum(1) - 1).clamp_min(0)[:, -m:]  # (B, m)
    positions = key_positions[:, m - n:]  # (B, n)
    itself = torch.arange(m, device=real.device)[None, :] == torch.arange(m - n, m, device=real.device)[:, None]
    allowed = causal_mask(n, m, offset=m - n, device=real.device) & real[:, None, -m:]  # (B, n, m)
    return positions, key_positions, (allowed | itself).unsqueeze(1)


def padded_positions_and_mask(real: Tensor, cached: int = 0, *,
                              keys: int | None = None) -> tuple[Tensor, AttentionMask]:
    """`padded_positions`' positions (B, n) and its keys as the batch's `AttentionMask` (B, 1, n, m)."""
    positions, _, allowed = padded_positions(real, cached, keys=keys)
    n, m = allowed.shape[-2:]
    return positions, AttentionMask.build(n, m, attn_mask=allowed, device=real.device)
