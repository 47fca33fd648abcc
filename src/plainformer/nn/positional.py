"""Positional encodings: absolute ones added to token embeddings (Vaswani et al. 2017, section 3.5), and
ALiBi's linear biases of the attention scores (Press et al. 2022).

    PE(pos, 2i)   = sin(pos / 10000^(2i/d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))

Each (sin, cos) pair at frequency ω_i turns through the angle k·ω_i when pos advances by k, so
PE(pos + k) = M_k · PE(pos) with M_k block-diagonal of 2×2 rotations, the same for every pos.

ALiBi adds no embedding: head h's score of query i for key j gets -m_h · (i - j), a penalty linear in the
distance, with the geometric slopes m_h of `alibi_slopes`. The masks add it (`masks.AttentionMask`), from
each query's and key's position.

The forwards do not check their inputs (they run in every model forward): the models check their
token ids' shape and positions against their context length, once, at their entry.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .. import _checks


def check_even_d_model(name: str, d_model: int) -> None:
    """Sinusoids come in (sin, cos) pairs: d_model must be even (a config's field check, too)."""
    if d_model % 2:
        raise ValueError(f"{name} must be even for sinusoidal positional encoding, got {d_model}")


def _frequencies(d_model: int) -> Tensor:
    """ω_i = 1 / 10000^(2i/d_model), i = 0 .. d_model/2-1, in float64: (d_model/2,)."""
    return torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))


def sinusoidal_table(max_len: int, d_model: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (max_len, d_model) table PE, computed in float64 and returned in `dtype`."""
    check_even_d_model("d_model", d_model)
    return _table(max_len, d_model, dtype)


def _table(max_len: int, d_model: int, dtype: torch.dtype) -> Tensor:
    position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    angles = position * _frequencies(d_model)  # (max_len, d_model/2)
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.to(dtype)


def relative_shift_matrix(k: int, d_model: int) -> Tensor:
    """M_k (d_model, d_model) in float64, block-diagonal rotations with PE(pos + k) = M_k · PE(pos)."""
    check_even_d_model("d_model", d_model)
    frequency = _frequencies(d_model)
    cos, sin = torch.cos(k * frequency), torch.sin(k * frequency)
    matrix = torch.zeros(d_model, d_model, dtype=torch.float64)
    even = torch.arange(0, d_model, 2)
    # sin(a + b) = sin a cos b + cos a sin b;  cos(a + b) = cos a cos b - sin a sin b
    matrix[even, even], matrix[even, even + 1] = cos, sin
    matrix[even + 1, even], matrix[even + 1, even + 1] = -sin, cos
    return matrix


def _check_sizes(d_model: int, max_len: int) -> None:
    _checks.check_positive_int("d_model", d_model)
    _checks.check_positive_int("max_len", max_len)


class SinusoidalPositionalEncoding(nn.Module):
    """x + PE[offset : offset+n] for x of shape (B, n, d_model); buffer `pe` is (max_len, d_model).
    validate_args=False skips the checks of the arguments (see `MultiHeadAttention`)."""

    pe: Tensor

    def __init__(self, d_model: int, max_len: int, *, validate_args: bool = True):
        super().__init__()
        if validate_args:
            _check_sizes(d_model, max_len)
            check_even_d_model("d_model", d_model)
        self.d_model, self.max_len = d_model, max_len
        self.register_buffer("pe", _table(max_len, d_model, torch.float32), persistent=False)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """x (B, n, d_model) at positions offset .. offset+n-1, or at `positions` (B, n) (each row its
        own: a left-padded batch) -> same shape; not checked here."""
        if positions is not None:
            return x + self.pe[positions].to(x.dtype)
        return x + self.pe[offset:offset + x.shape[1]].to(x.dtype)


class LearnedPositionalEmbedding(nn.Module):
    """x + P[offset : offset+n] with P a trained (max_len, d_model) table (GPT-2, BERT).
    validate_args=False skips the checks of the arguments (see `MultiHeadAttention`)."""

    def __init__(self, d_model: int, max_len: int, *, validate_args: bool = True):
        super().__init__()
        if validate_args:
            _check_sizes(d_model, max_len)
        self.d_model, self.max_len = d_model, max_len
        self.embedding = nn.Embedding(max_len, d_model)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """x (B, n, d_model) at positions offset .. offset+n-1, or at `positions` (B, n) (each row its
        own: a left-padded batch) -> same shape; not checked here."""
        if positions is None:
            positions = torch.arange(offset, offset + x.shape[1], device=x.device)
        return x + self.embedding(positions)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's slope m_h of each head (Press et al. 2022), float32 (n_heads,), by Bloom's rule for any count.

    For a power of two h: m_i = 2^(-8i/h), i = 1 .. h (h = 8: 1/2, 1/4, ..., 1/256). Otherwise the p = 2^⌊log₂ h⌋
    slopes of p heads come first, then the h - p slopes of 2p heads that fall between them (odd i):
    2^(-8i/(2p)) for i = 1, 3, 5, ...
    """
    _checks.check_positive_int("n_heads", n_heads)
    power = 2 ** math.floor(math.log2(n_heads))
    exponents = [8 * i / power for i in range(1, power + 1)]
    exponents += [8 * i / (2 * power) for i in range(1, 2 * (n_heads - power), 2)]
    return torch.tensor([2.0 ** -e for e in exponents], dtype=torch.float64).float()


def alibi_bias(slopes: Tensor, query_positions: Tensor, key_positions: Tensor) -> Tensor:
    """-m_h · (i - j) for slopes (h,), query positions i (B|1, n) and key positions j (B|1, m) -> (B|1, h, n, m),
    in the slopes' dtype."""
    distance = key_positions[:, None, None, :] - query_positions[:, None, :, None]  # j - i, (B|1, 1, n, m)
    return slopes[:, None, None] * distance.to(slopes.dtype)
