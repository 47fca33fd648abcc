"""Sinusoidal and learned positional encodings: the paper's formula, relative shifts, offsets, errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import plainformer as pf
from plainformer.nn.positional import alibi_bias, alibi_slopes, relative_shift_matrix, sinusoidal_table
from tests.reference.torch_reference import assert_close, sinusoidal_by_hand


@pytest.mark.parametrize("d_model", [2, 6, 16])
def test_table_matches_the_paper_formula_computed_by_hand(d_model):
    expected = sinusoidal_by_hand(50, d_model)
    assert_close(sinusoidal_table(50, d_model, dtype=torch.float64), expected)
    assert_close(pf.SinusoidalPositionalEncoding(d_model, 50).pe, expected.float())


def test_module_adds_the_table_to_its_input():
    pe = pf.SinusoidalPositionalEncoding(8, 20)
    assert pe.pe.shape == (20, 8)
    x = torch.randn(2, 5, 8)
    assert_close(pe(x), x + sinusoidal_by_hand(5, 8).float())


@settings(max_examples=60, deadline=None)
@given(d_model=st.integers(1, 16).map(lambda half: 2 * half), pos=st.integers(0, 200),
       k=st.integers(-200, 200))
def test_shift_by_k_is_a_fixed_linear_map(d_model, pos, k):
    """PE(pos + k) = M_k · PE(pos) with one M_k for every pos (section 3.5's motivation)."""
    table = sinusoidal_table(601, d_model, dtype=torch.float64)
    start = 200 + pos  # so that start + k >= 0 for every k drawn
    assert_close(relative_shift_matrix(k, d_model) @ table[start], table[start + k])


def test_shift_matrix_is_block_diagonal_and_orthogonal():
    matrix = relative_shift_matrix(7, 8)
    assert_close(matrix @ matrix.T, torch.eye(8, dtype=torch.float64))
    off_block = torch.ones(8, 8, dtype=torch.bool)
    for i in range(0, 8, 2):
        off_block[i:i + 2, i:i + 2] = False
    assert (matrix[off_block] == 0).all()


@pytest.mark.parametrize("offset", [0, 3, 15])
def test_offset_selects_the_rows_of_later_positions(offset):
    pe = pf.SinusoidalPositionalEncoding(8, 20)
    x = torch.randn(2, 5, 8)
    assert_close(pe(x, offset=offset), x + sinusoidal_by_hand(20, 8).float()[offset:offset + 5])


def test_sinusoidal_encoding_follows_the_input_dtype():
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    out = pf.SinusoidalPositionalEncoding(8, 10)(x)
    assert out.dtype == torch.float64
    assert_close((out - x)[0].float(), sinusoidal_by_hand(4, 8).float())


@pytest.mark.parametrize("offset", [0, 4])
def test_learned_embedding_adds_trainable_rows_at_the_offset(offset):
    torch.manual_seed(0)
    learned = pf.LearnedPositionalEmbedding(8, 10)
    x = torch.randn(2, 3, 8, requires_grad=True)
    out = learned(x, offset=offset)
    assert_close(out, x + learned.embedding.weight[offset:offset + 3])
    out.sum().backward()
    grad = learned.embedding.weight.grad
    used = torch.zeros(10, dtype=torch.bool)
    used[offset:offset + 3] = True
    assert (grad[used] == 2).all() and (grad[~used] == 0).all()  # each row used once per batch element


@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "learned"])
def test_sequences_past_max_len_are_refused_where_they_enter(pos_encoding):
    """The encodings check nothing (they run in every forward); the models that own them check the
    positions, cached ones included, at their entry."""
    model = pf.GPT(pf.GPTConfig(vocab_size=5, block_size=10, n_layers=1, n_heads=2, d_model=8, d_ff=16,
                                pos_encoding=pos_encoding))
    model(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="11 positions after 0 cached ones.*block_size=10"):
        model(torch.zeros(1, 11, dtype=torch.long))
    caches = model.new_kv_caches(1)
    model(torch.zeros(1, 6, dtype=torch.long), kv_caches=caches)
    with pytest.raises(ValueError, match="5 positions after 6 cached ones.*block_size=10"):
        model(torch.zeros(1, 5, dtype=torch.long), kv_caches=caches)
    encoder = pf.Encoder(5, 8, 2, 16, 1, max_len=10)
    with pytest.raises(ValueError, match="length 11.*max_len=10"):
        encoder(torch.zeros(1, 11, dtype=torch.long))


@pytest.mark.parametrize("d_model", [1, 7])
def test_odd_d_model_is_refused_for_sinusoids(d_model):
    with pytest.raises(ValueError, match=f"d_model must be even.*got {d_model}"):
        pf.SinusoidalPositionalEncoding(d_model, 10)
    with pytest.raises(ValueError, match=f"d_model must be even.*got {d_model}"):
        relative_shift_matrix(1, d_model)


@pytest.mark.parametrize("n_heads", [4, 6, 12])
def test_alibi_slopes_equal_blooms_alibi_tensor(n_heads):
    """Bloom's `build_alibi_tensor` holds m_h · j for key position j: at j = 1, the slopes. Bloom raises a
    float32 base to each power where ours rounds 2^(-8i/p) once, so they agree to float32's precision."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    theirs = build_alibi_tensor(torch.ones(1, 3, dtype=torch.long), n_heads, torch.float32)  # (h, 1, 3)
    ours = alibi_slopes(n_heads)
    assert ours.dtype == torch.float32 and ours.shape == (n_heads,)
    torch.testing.assert_close(ours, theirs[:, 0, 1], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[:, None] * torch.arange(3.0), theirs[:, 0], rtol=1e-6, atol=0)


def test_alibi_slopes_of_a_power_of_two_are_geometric_from_two_to_the_minus_eight_over_h():
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0 ** -(2 * i) for i in range(1, 5)]
    # 6 heads: the 4 of 4 heads, then the 2 of 8 heads that fall between them (2^-1, 2^-3)
    assert alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]


def test_alibi_bias_is_minus_slope_times_the_distance_of_each_rows_positions():
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    queries, keys = torch.tensor([[3, 4], [0, 1]]), torch.tensor([[0, 2, 3, 4], [0, 0, 0, 1]])
    bias = alibi_bias(slopes, queries, keys)
    assert bias.shape == (2, 2, 2, 4)
    for b, h, i, j in itertools.product(range(2), range(2), range(2), range(4)):
        assert bias[b, h, i, j] == -slopes[h] * (queries[b, i] - keys[b, j])
