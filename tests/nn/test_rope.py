"""Rotary position embedding: the rotation by hand, relative-position scores, norms, offsets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import plainformer as pf
from tests.reference.torch_reference import assert_close


def _hand_rope(x: torch.Tensor, positions: range, base: float = 10000.0) -> torch.Tensor:
    """Pairs (x_i, x_{i+d/2}) rotated by p·θ_i, θ_i = base^(-2i/d), written pair by pair in float64."""
    x = x.double()
    d = x.shape[-1]
    out = torch.empty_like(x)
    for row, p in enumerate(positions):
        for i in range(d // 2):
            angle = torch.tensor(p * base ** (-2 * i / d), dtype=torch.float64)
            a, b = x[..., row, i], x[..., row, i + d // 2]
            out[..., row, i] = a * angle.cos() - b * angle.sin()
            out[..., row, i + d // 2] = b * angle.cos() + a * angle.sin()
    return out


@pytest.mark.parametrize("offset", [0, 5])
def test_rotation_matches_the_hand_computation(offset):
    rope = pf.RotaryEmbedding(8, max_len=16)
    x = torch.randn(2, 3, 4, 8)
    assert_close(rope(x, offset=offset), _hand_rope(x, range(offset, offset + 4)).float())


def test_gradient_matches_finite_differences_in_float64():
    """The hand-written backward (the inverse rotation), and its own gradient, against gradcheck."""
    rope = pf.RotaryEmbedding(8, max_len=16).double()
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rope(t, offset=3), (x,))
    assert torch.autograd.gradgradcheck(lambda t: rope(t, offset=3), (x,))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 60), n=st.integers(0, 60), shift=st.integers(0, 60), seed=st.integers(0, 2**16))
def test_scores_depend_only_on_relative_position(m, n, shift, seed):
    """<rope(q, m), rope(k, n)> = <rope(q, m + s), rope(k, n + s)> for every shift s."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    rope = pf.RotaryEmbedding(16, max_len=128)
    score = (rope(q, offset=m) * rope(k, offset=n)).sum()
    shifted = (rope(q, offset=m + shift) * rope(k, offset=n + shift)).sum()
    assert_close(shifted, score)


def test_norms_are_preserved():
    rope = pf.RotaryEmbedding(16, max_len=64)
    x = torch.randn(2, 2, 64, 16)
    assert_close(rope(x).norm(dim=-1), x.norm(dim=-1))


def test_offset_continues_the_positions_of_a_longer_sequence():
    rope = pf.RotaryEmbedding(8, max_len=16)
    x = torch.randn(2, 3, 10, 8)
    assert_close(rope(x[:, :, 6:], offset=6), rope(x)[:, :, 6:])


def test_position_zero_is_the_identity():
    rope = pf.RotaryEmbedding(8, max_len=4)
    x = torch.randn(2, 1, 1, 8)
    assert torch.equal(rope(x), x)


def test_positions_past_max_len_are_refused_where_they_enter_attention():
    """The rotation itself checks nothing (it runs in every layer); attention's public entry checks
    the positions, cached ones included, and the head size."""
    rope = pf.RotaryEmbedding(8, max_len=10)
    mha = pf.MultiHeadAttention(16, 2)
    x = torch.zeros(1, 11, 16)
    with pytest.raises(ValueError, match="length 11.*max_len=10"):
        mha(x, x, x, rope=rope)
    cache = pf.KVCache(1, 2, max_len=16, head_dim=8)
    cache.append(torch.zeros(1, 2, 7, 8), torch.zeros(1, 2, 7, 8))
    with pytest.raises(ValueError, match="length 11.*max_len=10"):
        mha(x[:, :4], x[:, :4], x[:, :4], rope=rope, kv_cache=cache)
    with pytest.raises(ValueError, match="rope has head_dim = 6 but the attention heads have head_dim = 8"):
        mha(x[:, :4], x[:, :4], x[:, :4], rope=pf.RotaryEmbedding(6, max_len=10))
