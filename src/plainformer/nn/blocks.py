"""Residual sublayers with normalisation, and the encoder stack (Vaswani et al. 2017, section 3.1).

Post-LN, as in the paper:   x = LayerNorm(x + Dropout(MultiHead(x, x, x)))
                            x = LayerNorm(x + Dropout(FFN(x)))
Pre-LN (norm_first=True):   x = x + Dropout(MultiHead(LN(x), LN(x), LN(x)))
                            x = x + Dropout(FFN(LN(x)))

BERT's layer is the post-LN encoder layer; GPT's block is its own `models.gpt.Block`, built from
its config.

The decoder layer and stack of the encoder-decoder Transformer (Vaswani et al. 2017, section 3.1).

Post-LN, as in the paper (y: target positions, z: encoder memory):

    y = LayerNorm(y + Dropout(MultiHead(y, y, y)))       masked: position i attends positions <= i
    y = LayerNorm(y + Dropout(MultiHead(y, z, z)))       cross-attention over the source
    y = LayerNorm(y + Dropout(FFN(y)))

Pre-LN (norm_first=True) computes y = y + Dropout(Sublayer(LN(y))) for each of the three, and the stack
ends with a LayerNorm. Decoding one position at a time keeps two caches per layer: the self-attention
keys/values of the positions decoded so far, and the cross-attention keys/values of the memory, which
are projected once per source (`DecoderLayer.memory_kv_cache`) and reused at every step.

The stacks check their inputs once, build one `AttentionMask` per attention kind for the batch and
hand it to every layer, which hands it to its attention modules; a layer or an attention module
called with plain masks checks and combines them itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import Tensor, nn

from .. import _checks
from .attention import MultiHeadAttention, check_attention_args
from .feedforward import FeedForward, check_feedforward_args
from .kv_cache import KVCache
from .masks import AttentionMask, check_masks
from .normalization import NORMS, make_norm
from .positional import SinusoidalPositionalEncoding, check_even_d_model

if TYPE_CHECKING:
    from .rope import Rotation


def check_layer_args(d_model: int, n_heads: int, d_ff: int, *, dropout: float, activation: str,
                     n_kv_heads: int | None, norm: str, attention_dropout: float | None, backend: str) -> None:
    """An encoder or decoder layer's arguments, each checked once (its sublayers then skip theirs)."""
    check_attention_args(d_model, n_heads, n_kv_heads, dropout, backend)
    if attention_dropout is not None:
        _checks.check_probability("attention_dropout", attention_dropout)
    check_feedforward_args(d_ff, activation)
    _checks.check_choice("norm", norm, NORMS)


class _ResidualLayer(nn.Module):
    """What the encoder and decoder layers share: self-attention (and, in the decoder, cross-attention)
    and a feed-forward sublayer, one norm and one dropout per sublayer, and the residual wiring.

    Submodules: `self_attn` (and `cross_attn`), `ff`, `norm1` .. `norm{k}`, `dropout1` .. `dropout{k}`.
    The attention takes d_model, n_heads, n_kv_heads, bias, backend and attention_dropout (default:
    dropout); the feed-forward d_ff, activation and activation_dropout (on its hidden layer; default:
    dropout); the norms norm and norm_eps; norm_first
    is pre-LN. validate_args=False skips the checks: for a layer built by a stack or a model that
    checked them (see `MultiHeadAttention`).
    """

    cross_attention: ClassVar[bool]  # the decoder's layers also attend to the encoder's memory
    norm1: nn.Module  # registered by add_module, in a loop
    norm2: nn.Module
    dropout1: nn.Module
    dropout2: nn.Module

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, n_kv_heads: int | None = None,
                 norm: str = "layernorm", norm_eps: float = 1e-5, bias: bool = True,
                 attention_dropout: float | None = None, activation_dropout: float | None = None,
                 backend: str = "auto", validate_args: bool = True):
        super().__init__()
        if validate_args:
            check_layer_args(d_model, n_heads, d_ff, dropout=dropout, activation=activation,
                             n_kv_heads=n_kv_heads, norm=norm, attention_dropout=attention_dropout,
                             backend=backend)
            if activation_dropout is not None:
                _checks.check_probability("activation_dropout", activation_dropout)
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        activation_dropout = dropout if activation_dropout is None else activation_dropout
        self.norm_first = norm_first

        def attention() -> MultiHeadAttention:
            return MultiHeadAttention(d_model, n_heads, n_kv_heads=n_kv_heads, bias=bias,
                                      dropout=attention_dropout, backend=backend, validate_args=False)

        self.self_attn = attention()
        if self.cross_attention:
            self.cross_attn = attention()
        self.ff = FeedForward(d_model, d_ff, activation, activation_dropout, bias=bias, validate_args=False)
        sublayers = 3 if self.cross_attention else 2
        for i in range(1, sublayers + 1):
            self.add_module(f"norm{i}", make_norm(norm, d_model, eps=norm_eps, bias=bias, validate_args=False))
        for i in range(1, sublayers + 1):
            self.add_module(f"dropout{i}", nn.Dropout(dropout))

    def check_states(self, name: str, x: Tensor) -> None:
        """x is a floating (B, n, d_model) tensor: checked when a layer is called on its own."""
        _checks.check_tensor(name, x, ndim=3, shape_doc="(B, n, d_model)")
        _checks.check_floating(name, x)
        _checks.check_last_dim(name, x, self.self_attn.d_model, "d_model")

    def residual(self, x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module,
                 dropout: nn.Module) -> Tensor:
        """LN(x + Dropout(Sublayer(x))) post-LN, or x + Dropout(Sublayer(LN(x))) pre-LN."""
        if self.norm_first:
            return x + dropout(sublayer(norm(x)))
        return norm(x + dropout(sublayer(x)))


class EncoderLayer(_ResidualLayer):
    """Self-attention then feed-forward, each wrapped in dropout, a residual and a norm.

    Submodules: `self_attn` (MultiHeadAttention), `ff` (FeedForward), `norm1`, `norm2`.
    EncoderLayer(d_model, n_heads, d_ff, **options): the options of `_ResidualLayer`.
    """

    cross_attention = False

    def forward(self, x: Tensor, mask: Tensor | AttentionMask | None = None, *,
                key_padding_mask: Tensor | None = None, is_causal: bool = False,
                rope: Rotation | None = None, kv_cache: KVCache | None = None) -> Tensor:
        """x: (B, n, d_model) -> (B, n, d_model).

        mask: the batch's `AttentionMask` (what the stacks pass; nothing is checked then), or the
        masks of `MultiHeadAttention.forward` given as mask, key_padding_mask and is_causal.
        kv_cache: decode incrementally, x holding the positions after the cached ones.
        """
        if not isinstance(mask, AttentionMask):
            self.check_states("x", x)
            mask = self.self_attn.mask_for(x, x, x, mask, key_padding_mask=key_padding_mask,
                                           is_causal=is_causal, rope=rope, kv_cache=kv_cache)

        def attend(h: Tensor) -> Tensor:
            return self.self_attn(h, h, h, mask, rope=rope, kv_cache=kv_cache)

        x = self.residual(x, attend, self.norm1, self.dropout1)
        return self.residual(x, self.ff, self.norm2, self.dropout2)


class TokenStack(nn.Module):
    """What the encoder and decoder stacks share: token embedding · √d_model + sinusoidal PE and
    dropout in front of N layers of `layer_type`, then a final LayerNorm when they are pre-LN.
    The embedding of `pad_id` is kept at zero. The layer options (dropout .. backend) are those of
    `_ResidualLayer`; validate_args=False skips the checks (a model's config made them).
    """

    layer_type: ClassVar[Callable[..., nn.Module]]  # EncoderLayer or DecoderLayer

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, d_ff: int, n_layers: int,
                 max_len: int, *, pad_id: int | None = None, dropout: float = 0.1,
                 attention_dropout: float | None = None, activation_dropout: float | None = None,
                 activation: str = "relu", norm_first: bool = False, n_kv_heads: int | None = None,
                 norm_eps: float = 1e-5, backend: str = "auto", validate_args: bool = True):
        super().__init__()
        if validate_args:
            for name, value in (("vocab_size", vocab_size), ("n_layers", n_layers), ("max_len", max_len)):
                _checks.check_positive_int(name, value)
            if pad_id is not None:
                _checks.check_index("pad_id", pad_id, vocab_size, "vocab_size")
            check_layer_args(d_model, n_heads, d_ff, dropout=dropout, activation=activation,
                             n_kv_heads=n_kv_heads, norm="layernorm", attention_dropout=attention_dropout,
                             backend=backend)
            if activation_dropout is not None:
                _checks.check_probability("activation_dropout", activation_dropout)
            check_even_d_model("d_model", d_model)
        self.vocab_size, self.d_model, self.pad_id = vocab_size, d_model, pad_id
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.positional = SinusoidalPositionalEncoding(d_model, max_len, validate_args=False)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            self.layer_type(d_model, n_heads, d_ff, dropout=dropout, attention_dropout=attention_dropout,
                            activation_dropout=activation_dropout, activation=activation, norm_first=norm_first,
                            n_kv_heads=n_kv_heads, norm_eps=norm_eps, backend=backend, validate_args=False)
            for _ in range(n_layers))
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

    layer_type = EncoderLayer

    def padding_mask(self, src: Tensor) -> Tensor | None:
        """(B, n) boolean, True = real token; None without a pad_id."""
        return None if self.pad_id is None else src != self.pad_id

    def forward(self, src: Tensor, *, key_padding_mask: Tensor | None = None) -> Tensor:
        """src (B, n) -> memory (B, n, d_model). key_padding_mask defaults to `src != pad_id`."""
        _checks.check_token_id_tensor("src", src)
        batch, n = src.shape
        _checks.check_max_len("src", n, self.max_len)
        if key_padding_mask is None:
            key_padding_mask = self.padding_mask(src)
        else:
            _checks.check_key_padding_mask("key_padding_mask", key_padding_mask, batch, n, src.device)
        mask = AttentionMask.build(n, n, key_padding_mask=key_padding_mask, device=src.device)
        x = _checks.lookup_token_ids("src", src, self.vocab_size, self.embed)
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


@dataclasses.dataclass
class DecoderCache:
    """The caches of one decoder layer: its own past positions and the projected memory.

    sources (B,), when given, names the source of each row: rows with the same source hold the same
    memory keys/values (the beams of one sentence), so a reorder that keeps every row's source
    leaves the memory cache as it is instead of copying it. rows_per_source r: rows b·r .. b·r+r-1
    hold source b (0 once a reorder has mixed them).
    """

    self_attn: KVCache
    cross_attn: KVCache
    sources: Tensor | None = None
    rows_per_source: int = 0

    def reorder(self, batch_indices: Tensor, *, group_size: int | None = None, whole_groups: int | None = None
                ) -> None:
        """Keep batch rows `batch_indices` in both caches (beam search moves hypotheses around).

        group_size g: the caller promises that each index stays in its block of g rows (beam search:
        the beams of one sentence). When those blocks lie within one source's rows, the memory cache
        is kept without reading the indices, which would cost a host sync per layer and step.
        whole_groups g: the indices keep whole blocks of g rows, in order (beam search leaving out the
        sentences done): each row keeps its source's memory, so the rows per source stay as they were.
        """
        if whole_groups is not None:
            self.self_attn.reorder(batch_indices)
            self.cross_attn.reorder(batch_indices)
            if self.sources is not None:
                self.sources = self.sources[batch_indices]
            return
        self.self_attn.reorder(batch_indices)
        if group_size is not None and self.rows_per_source and self.rows_per_source % group_size == 0:
            return
        if self.sources is not None and torch.equal(self.sources[batch_indices], self.sources):
            return
        self.cross_attn.reorder(batch_indices)
        if self.sources is not None:
            self.sources = self.sources[batch_indices]
        self.rows_per_source = 0


class DecoderLayer(_ResidualLayer):
    """Masked self-attention, cross-attention over the memory, feed-forward; each wrapped in dropout,
    a residual connection and a norm.

    Submodules: `self_attn`, `cross_attn` (MultiHeadAttention), `ff` (FeedForward), `norm1`..`norm3`.
    DecoderLayer(d_model, n_heads, d_ff, **options): the options of `_ResidualLayer`.
    """

    cross_attention = True
    cross_attn: MultiHeadAttention
    norm3: nn.Module
    dropout3: nn.Module

    def forward(self, x: Tensor, memory: Tensor, tgt_mask: Tensor | AttentionMask | None = None, *,
                memory_mask: Tensor | AttentionMask | None = None, is_causal: bool = False,
                tgt_key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None, self_kv_cache: KVCache | None = None,
                cross_kv_cache: KVCache | None = None) -> Tensor:
        """x (B, n, d_model) target positions, memory (B, m, d_model) -> (B, n, d_model).

        tgt_mask (n, n) / memory_mask (n, m) and the key-padding masks (B, n) / (B, m) are boolean,
        True = may attend (or additive float for the first two), as in `MultiHeadAttention.forward`;
        or tgt_mask and memory_mask are the batch's `AttentionMask`s (what `Decoder` passes; nothing
        is checked then). is_causal: position i sees target positions <= i. self_kv_cache holds the
        positions decoded so far; cross_kv_cache (static) the memory's keys and values, see
        `memory_kv_cache`.
        """
        if not isinstance(tgt_mask, AttentionMask):
            self.check_states("x", x)
            tgt_mask = self.self_attn.mask_for(x, x, x, tgt_mask, key_padding_mask=tgt_key_padding_mask,
                                               is_causal=is_causal, kv_cache=self_kv_cache)
        if not isinstance(memory_mask, AttentionMask):
            self.check_states("memory", memory)
            memory_mask = self.cross_attn.mask_for(x, memory, memory, memory_mask,
                                                   key_padding_mask=memory_key_padding_mask,
                                                   kv_cache=cross_kv_cache)

        def self_attend(h: Tensor) -> Tensor:
            return self.self_attn(h, h, h, tgt_mask, kv_cache=self_kv_cache)

        def cross_attend(h: Tensor) -> Tensor:
            return self.cross_attn(h, memory, memory, memory_mask, kv_cache=cross_kv_cache)

        x = self.residual(x, self_attend, self.norm1, self.dropout1)
        x = self.residual(x, cross_attend, self.norm2, self.dropout2)
        return self.residual(x, self.ff, self.norm3, self.dropout3)

    def memory_kv_cache(self, memory: Tensor, *, repeats: int = 1) -> KVCache:
        """A static cache holding memory W^K and memory W^V, (B·repeats, h_kv, m, d_k) each.

        Row b of the memory fills rows b·repeats .. b·repeats + repeats - 1 (the beams of source b).
        """
        attn = self.cross_attn
        k, v = attn.project_kv(memory, memory)  # (B, h_kv, m, d_k)
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=0), v.repeat_interleave(repeats, dim=0)
        cache = KVCache(k.shape[0], attn.n_kv_heads, k.shape[2], attn.head_dim,
                        dtype=k.dtype, device=k.device, static=True)
        cache.append(k, v)
        return cache


class Decoder(TokenStack):
    """Token embedding · √d_model + sinusoidal PE, dropout, N decoder layers (+ final LN if pre-LN).

    tgt (B, n) token ids and memory (B, m, d_model) -> (B, n, d_model); the output projection to
    the vocabulary belongs to the model. The embedding of `pad_id` is kept at zero.
    """

    layer_type = DecoderLayer

    def forward(self, tgt: Tensor, memory: Tensor, *, tgt_key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None,
                kv_caches: list[DecoderCache] | None = None) -> Tensor:
        """tgt (B, n), memory (B, m, d_model) -> (B, n, d_model), causal over the target.

        tgt_key_padding_mask (B, n) and memory_key_padding_mask (B, m) mark real tokens (True); None
        means no padding. With right-padded targets the causal mask already keeps every real position
        from seeing a pad, so the target mask changes only the outputs at padded positions.
        kv_caches (one per layer, see `new_kv_caches`): decode incrementally; tgt then holds only
        the positions after the cached ones.
        """
        self_mask, memory_mask = self._masks(tgt, memory, tgt_key_padding_mask, memory_key_padding_mask,
                                             kv_caches)
        offset = 0 if kv_caches is None else kv_caches[0].self_attn.length
        x = _checks.lookup_token_ids("tgt", tgt, self.vocab_size, lambda ids: self.embed(ids, offset))
        for i, layer in enumerate(self.layers):
            cache = None if kv_caches is None else kv_caches[i]
            x = layer(x, memory, self_mask, memory_mask=memory_mask,
                      self_kv_cache=None if cache is None else cache.self_attn,
                      cross_kv_cache=None if cache is None else cache.cross_attn)
        return self.norm(x)

    def _masks(self, tgt: Tensor, memory: Tensor, tgt_key_padding_mask: Tensor | None,
               memory_key_padding_mask: Tensor | None,
               kv_caches: list[DecoderCache] | None) -> tuple[AttentionMask, AttentionMask]:
        """Validate `forward`'s inputs (shapes only) and build the self- and cross-attention masks."""
        _checks.check_token_id_tensor("tgt", tgt)
        if kv_caches is not None:
            _checks.check_one_per_layer("kv_caches", kv_caches, len(self.layers), "DecoderCache")
        offset = 0 if kv_caches is None else kv_caches[0].self_attn.length
        (batch, n), m = tgt.shape, offset + tgt.shape[1]
        _checks.check_max_len("tgt (cached positions included)", m, self.max_len)
        _checks.check_tensor("memory (the keys and values of cross-attention)", memory, ndim=3,
                             shape_doc="(B, m, d_model)")
        _checks.check_floating("memory", memory)
        _checks.check_last_dim("memory", memory, self.d_model, "d_model")
        _checks.check_same_device(tgt=tgt, memory=memory)
        if memory.shape[0] != batch:
            raise ValueError(f"memory must have the batch size of tgt ({batch}), got {tuple(memory.shape)}")
        heads = cast(DecoderLayer, self.layers[0]).self_attn.n_heads
        check_masks(batch, heads, n, m, tgt.device, key_padding_mask=tgt_key_padding_mask,
                    key_padding_name="tgt_key_padding_mask")
        check_masks(batch, heads, n, memory.shape[1], tgt.device, key_padding_mask=memory_key_padding_mask,
                    key_padding_name="memory_key_padding_mask")
        self_mask = AttentionMask.build(n, m, is_causal=True, cached=offset,
                                        key_padding_mask=tgt_key_padding_mask, device=tgt.device)
        return self_mask, AttentionMask.build(n, memory.shape[1], key_padding_mask=memory_key_padding_mask)

    def new_kv_caches(self, memory: Tensor, max_len: int | None = None, *,
                      repeats: int = 1) -> list[DecoderCache]:
        """One `DecoderCache` per layer for B·repeats rows decoding up to max_len positions
        (default: the positional table's length); the memory's keys/values are projected here, once."""
        _checks.check_tensor("memory", memory, ndim=3, shape_doc="(B, m, d_model)")
        _checks.check_positive_int("repeats", repeats)
        max_len = self.max_len if max_len is None else _checks.check_positive_int("max_len", max_len)
        parameter = self.embedding.weight
        sources = torch.arange(memory.shape[0], device=memory.device).repeat_interleave(repeats)
        caches = []
        for layer in cast(Iterable[DecoderLayer], self.layers):
            attn = layer.self_attn
            own = KVCache(memory.shape[0] * repeats, attn.n_kv_heads, max_len, attn.head_dim,
                          dtype=parameter.dtype, device=parameter.device)
            caches.append(DecoderCache(own, layer.memory_kv_cache(memory, repeats=repeats), sources, repeats))
        return caches
