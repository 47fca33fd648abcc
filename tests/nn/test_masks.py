"""Tests for plainformer.nn.masks: one AttentionMask per batch, combined as the backends need it.

The reference is a hand-built boolean (B, h, n, m) mask, one entry at a time, from the definitions:
query i at position P + i sees key j when j <= P + i (causal), key j is real (padding) and the
user's mask allows it.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import plainformer as pf
from plainformer.nn.masks import AttentionMask, check_masks, padded_positions_and_mask
from tests.reference.torch_reference import assert_close

B, H = 2, 3


def _by_hand(n: int, m: int, cached: int, causal: bool, padding, attn_mask) -> torch.Tensor:
    allowed = torch.ones(B, H, n, m, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(B), range(H), range(n), range(m)):
        if causal and j > cached + i:
            allowed[b, h, i, j] = False
        if padding is not None and not padding[b, j]:
            allowed[b, h, i, j] = False
        if attn_mask is not None and not attn_mask.expand(B, H, n, m)[b, h, i, j]:
            allowed[b, h, i, j] = False
    return allowed


@pytest.mark.parametrize("n, m, cached", [(4, 4, 0), (3, 5, 0), (2, 5, 3), (1, 6, 5)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_padding", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_dense_mask_combines_causal_padding_and_user_mask(n, m, cached, causal, with_padding, with_mask):
    g = torch.Generator().manual_seed(n * 10 + m)
    padding = (torch.rand(B, m, generator=g) < 0.7) if with_padding else None
    attn_mask = (torch.rand(1, H, n, m, generator=g) < 0.7) if with_mask else None
    mask = AttentionMask.build(n, m, is_causal=causal, cached=cached, key_padding_mask=padding,
                               attn_mask=attn_mask)
    expected = _by_hand(n, m, cached, causal, padding, attn_mask)
    if mask.dense is None:
        assert expected.all()
    else:
        assert torch.equal(mask.dense.expand(B, H, n, m), expected)


def test_causal_alone_needs_no_mask_tensor_for_the_fused_backends():
    mask = AttentionMask.build(5, 5, is_causal=True)
    assert mask.only_causal and mask.is_causal and mask.key_padding is None and mask.attn_mask is None
    assert torch.equal(mask.dense, pf.causal_mask(5, 5))


def test_one_newest_query_after_cached_positions_sees_every_key():
    mask = AttentionMask.build(1, 7, is_causal=True, cached=6)
    assert not mask.is_causal and mask.only_causal and mask.dense is None  # nothing to mask at all


def test_cached_positions_shift_the_causal_diagonal_by_an_offset():
    """torch's is_causal is top-left aligned, so sdpa reads the shifted mask from `dense`; flash takes the
    offset itself."""
    mask = AttentionMask.build(2, 5, is_causal=True, cached=3)
    assert mask.is_causal and mask.offset == 3 and mask.attn_mask is None and not mask.only_causal
    assert torch.equal(mask.dense, pf.causal_mask(2, 5, offset=3))


@pytest.mark.parametrize("n, m", [(4, 4), (2, 5), (1, 6)])
def test_a_decoders_causal_mask_puts_its_queries_at_the_last_positions_as_build_does(n, m):
    mask, built = AttentionMask.causal(n, m), AttentionMask.build(n, m, is_causal=True, cached=m - n)
    dense = torch.ones(n, m, dtype=torch.bool) if mask.dense is None else mask.dense
    assert torch.equal(dense.expand(B, H, n, m), _by_hand(n, m, m - n, True, None, None))
    assert (mask.is_causal, mask.offset, mask.only_causal) == (built.is_causal, built.offset, built.only_causal)
    assert (mask.dense is None and built.dense is None) or torch.equal(mask.dense, built.dense)


@pytest.mark.parametrize("cached", [0, 2])
def test_padded_rows_count_their_real_tokens_and_see_no_padding_key_but_their_own(cached):
    real = torch.tensor([[True] * 6, [False, False, True, True, False, True]])
    positions, mask = padded_positions_and_mask(real, cached)
    assert positions.tolist() == [[0, 1, 2, 3, 4, 5][cached:], [0, 0, 0, 1, 1, 2][cached:]]
    n = 6 - cached
    expected = torch.tensor([[[(j <= cached + i and bool(real[b, j])) or j == cached + i for j in range(6)]
                              for i in range(n)] for b in range(2)])
    assert torch.equal(mask.dense, expected[:, None])  # (B, 1, n, m)


def test_an_additive_mask_stays_additive_and_takes_the_scores_dtype():
    additive = torch.randn(3, 4, dtype=torch.float64)
    padding = torch.tensor([[True, True, False, True], [True, True, True, True]])
    mask = AttentionMask.build(3, 4, key_padding_mask=padding, attn_mask=additive)
    dense = mask.dense_for(torch.float32)
    assert dense.dtype == torch.float32 and dense.shape == (2, 1, 3, 4)
    assert torch.isinf(dense[0, 0, :, 2]).all()
    assert_close(dense[1, 0], additive.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_boolean_mask_becomes_additive_zero_where_allowed_and_minus_inf_elsewhere(dtype):
    padding = torch.tensor([[True, True, False, True], [True, False, True, True]])
    mask = AttentionMask.build(4, 4, is_causal=True, key_padding_mask=padding)
    additive = mask.additive_for(dtype)
    assert additive.dtype == dtype and additive.shape == mask.dense.shape
    assert torch.equal(additive == 0, mask.dense)
    assert torch.equal(additive == float("-inf"), ~mask.dense)
    assert AttentionMask().additive_for(dtype) is None


def test_check_masks_names_the_bad_mask():
    with pytest.raises(ValueError, match=r"tgt_key_padding_mask must have shape \(B, m\) = \(2, 4\)"):
        check_masks(2, 3, 4, 4, torch.device("cpu"), key_padding_mask=torch.ones(2, 5, dtype=torch.bool),
                    key_padding_name="tgt_key_padding_mask")
    with pytest.raises(TypeError, match="mask must be boolean"):
        check_masks(2, 3, 4, 4, torch.device("cpu"), attn_mask=torch.ones(4, 4, dtype=torch.long))
    assert check_masks(2, 3, 4, 5, torch.device("cpu"), attn_mask=torch.ones(2, 4, 5)).shape == (2, 1, 4, 5)


def test_a_layer_given_the_batch_mask_matches_the_layer_given_raw_masks():
    """What the stacks do (build once, hand it over) equals what a layer called alone does."""
    torch.manual_seed(0)
    layer = pf.EncoderLayer(12, H, 24, dropout=0.0).double()  # two of our paths: float64, 1e-10
    x = torch.randn(B, 5, 12, dtype=torch.float64)
    padding = torch.ones(B, 5, dtype=torch.bool)
    padding[1, 3:] = False
    built = AttentionMask.build(5, 5, is_causal=True, key_padding_mask=padding)
    assert_close(layer(x, built), layer(x, key_padding_mask=padding, is_causal=True))


def test_alibi_makes_the_dense_mask_additive_minus_slope_times_the_distance():
    slopes = torch.tensor([0.5, 0.25, 0.125])
    padding = torch.tensor([[True, True, False, True, True], [True] * 5])
    mask = AttentionMask.build(2, 5, is_causal=True, cached=3, key_padding_mask=padding, alibi=slopes)
    assert mask.alibi is slopes and mask.offset == 3 and not mask.only_causal
    allowed = _by_hand(2, 5, 3, True, padding, None)
    expected = torch.full((B, H, 2, 5), -torch.inf)
    for b, h, i, j in itertools.product(range(B), range(H), range(2), range(5)):
        if allowed[b, h, i, j]:
            expected[b, h, i, j] = -slopes[h] * (3 + i - j)
    assert torch.equal(mask.dense.expand(B, H, 2, 5), expected)
    assert torch.equal(mask.additive_for(torch.float32).expand(B, H, 2, 5), expected)


@pytest.mark.parametrize("n, m, cached", [(7, 7, 0), (3, 8, 5), (2, 4, 2)])
def test_a_window_lets_query_i_see_the_keys_of_mistrals_sliding_window(n, m, cached):
    """transformers' sliding_window_overlay: key j is visible to query i iff i - w < j <= i (i at cached + i)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    visible = sliding_window_causal_mask_function(3)
    batch, head = torch.tensor(0), torch.tensor(0)
    expected = visible(batch, head, cached + torch.arange(n)[:, None], torch.arange(m)[None, :])
    mask = AttentionMask.build(n, m, is_causal=True, cached=cached, window=3)
    assert mask.window == 3 and not mask.only_causal
    assert torch.equal(mask.dense.expand(n, m), expected)


def test_a_window_that_hides_no_key_is_dropped():
    assert AttentionMask.build(3, 3, is_causal=True, window=3).window is None  # query 2 sees keys 0 .. 2
    assert AttentionMask.build(1, 4, is_causal=True, cached=3, window=4) == AttentionMask.build(1, 4, cached=3)
    assert AttentionMask.build(4, 4, is_causal=True, window=3).window == 3


@pytest.mark.parametrize("n, m, cached", [(7, 7, 0), (3, 8, 5), (2, 4, 2), (1, 6, 5), (5, 3, 0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 2, 3])
@pytest.mark.parametrize("with_padding", [False, True])
def test_rows_see_a_key_only_where_no_row_of_the_hand_built_mask_is_empty(n, m, cached, causal, window,
                                                                         with_padding):
    """The plain softmax's licence: claimed only where every query keeps a key (a padding mask may hide a row)."""
    padding = torch.zeros(B, m, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True) if with_padding else None
    allowed = _by_hand(n, m, cached, causal, padding, None)
    if window is not None:
        position = cached + torch.arange(n)[:, None]
        allowed = allowed & (torch.arange(m)[None, :] > position - window)
    mask = AttentionMask.build(n, m, is_causal=causal, cached=cached, key_padding_mask=padding, window=window)
    if mask.rows_see_a_key:
        assert allowed.any(dim=-1).all()
    if not with_padding and (window is None or cached + n <= m):
        assert mask.rows_see_a_key  # the cases a model's own self-attention meets take the fused softmax
