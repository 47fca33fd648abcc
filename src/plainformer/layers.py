"""Residual sublayers with normalisation, and the encoder stack (Vaswani et al. 2017, section 3.1).

Post-LN, as in the paper:   x = LayerNorm(x + Dropout(MultiHead(x, x, x)))
                            x = LayerNorm(x + Dropout(FFN(x)))
Pre-LN (norm_first=True):   x = x + Dropout(MultiHead(LN(x), LN(x), LN(x)))
                            x = x + Dropout(FFN(LN(x)))

A GPT block is the pre-LN encoder layer with a causal mask, so the decoder-only models reuse it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from torch import Tensor, nn

from . import _checks
from .attention import MultiHeadAttention
from .feedforward import FeedForward
from .normalization import make_norm
from .positional import SinusoidalPositionalEncoding

if TYPE_CHECKING:
    from .kv_cache import KVCache
    from .rope import RotaryEmbedding


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in dropout, a residual and a norm.

    Submodules: `self_attn` (MultiHeadAttention), `ff` (FeedForward), `norm1`, `norm2`.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, n_kv_heads: int | None = None,
                 norm: str = "layernorm", norm_eps: float = 1e-5, bias: bool = True,
                 attention_dropout: float | None = None, backend: str = "auto"):
        super().__init__()
        _checks.check_probability("dropout", dropout)
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, n_kv_heads=n_kv_heads, bias=bias,
                                            dropout=attention_dropout, backend=backend)
        self.ff = FeedForward(d_model, d_ff, activation, dropout, bias=bias)
        self.norm1 = make_norm(norm, d_model, eps=norm_eps, bias=bias)
        self.norm2 = make_norm(norm, d_model, eps=norm_eps, bias=bias)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None, *, key_padding_mask: Tensor | None = None,
                is_causal: bool = False, rope: RotaryEmbedding | None = None,
                kv_cache: KVCache | None = None) -> Tensor:
        """x: (B, n, d_model) -> (B, n, d_model). Masks as in `MultiHeadAttention.forward`."""
        def attend(h: Tensor) -> Tensor:
            return self.dropout1(self.self_attn(h, h, h, mask, key_padding_mask=key_padding_mask,
                                                is_causal=is_causal, rope=rope, kv_cache=kv_cache))

        if self.norm_first:
            x = x + attend(self.norm1(x))
            return x + self.dropout2(self.ff(self.norm2(x)))
        x = self.norm1(x + attend(x))
        return self.norm2(x + self.dropout2(self.ff(x)))


class TokenStack(nn.Module):
    """What the encoder and decoder stacks share: token embedding · √d_model + sinusoidal PE and
    dropout in front of N layers made by `make_layer`, then a final LayerNorm when they are pre-LN.
    The embedding of `pad_id` is kept at zero."""

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, max_len: int,
                 make_layer: Callable[[], nn.Module], *, pad_id: int | None, dropout: float,
                 norm_first: bool, norm_eps: float):
        super().__init__()
        _checks.check_positive_int("vocab_size", vocab_size)
        _checks.check_positive_int("d_model", d_model)
        _checks.check_positive_int("n_layers", n_layers)
        _checks.check_probability("dropout", dropout)
        if pad_id is not None:
            _checks.check_index("pad_id", pad_id, vocab_size, "vocab_size")
        self.vocab_size, self.d_model, self.pad_id = vocab_size, d_model, pad_id
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.positional = SinusoidalPositionalEncoding(d_model, max_len)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(make_layer() for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model, eps=norm_eps) if norm_first else nn.Identity()

    @property
    def max_len(self) -> int:
        return self.positional.max_len

    def embed(self, ids: Tensor, offset: int = 0) -> Tensor:
        """(B, n) ids at positions offset .. offset+n-1 -> (B, n, d_model): E[ids] · √d_model + PE, dropout."""
        x = self.embedding(ids) * math.sqrt(self.d_model)
        return self.dropout(self.positional(x, offset))


class Encoder(TokenStack):
    """Token embedding · √d_model + sinusoidal PE, dropout, N encoder layers (+ final LN if pre-LN).

    src: (B, n) token ids -> (B, n, d_model). Tokens equal to `pad_id` are never attended to.
    """

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, d_ff: int, n_layers: int,
                 max_len: int, *, pad_id: int | None = None, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, n_kv_heads: int | None = None,
                 norm_eps: float = 1e-5, backend: str = "auto"):
        def make_layer() -> EncoderLayer:
            return EncoderLayer(d_model, n_heads, d_ff, dropout=dropout, activation=activation,
                                norm_first=norm_first, n_kv_heads=n_kv_heads, norm_eps=norm_eps,
                                backend=backend)

        super().__init__(vocab_size, d_model, n_layers, max_len, make_layer, pad_id=pad_id,
                         dropout=dropout, norm_first=norm_first, norm_eps=norm_eps)

    def padding_mask(self, src: Tensor) -> Tensor | None:
        """(B, n) boolean, True = real token; None without a pad_id."""
        return None if self.pad_id is None else src != self.pad_id

    def forward(self, src: Tensor, *, key_padding_mask: Tensor | None = None) -> Tensor:
        """src (B, n) -> memory (B, n, d_model). key_padding_mask defaults to `src != pad_id`."""
        _checks.check_token_ids("src", src, self.vocab_size)
        _checks.check_max_len("src", src.shape[1], self.max_len)
        if key_padding_mask is None:
            key_padding_mask = self.padding_mask(src)
        x = self.embed(src)
        for layer in self.layers:
            x = layer(x, key_padding_mask=key_padding_mask)
        return self.norm(x)
