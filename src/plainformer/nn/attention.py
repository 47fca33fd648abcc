"""Scaled dot-product attention and multi-head attention (Vaswani et al. 2017, section 3.2).

    Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V,   Q: (..., n, d_k), K: (..., m, d_k), V: (..., m, d_v)

    head_i    = Attention(Q W_i^Q, K W_i^K, V W_i^V)
    MultiHead = Concat(head_1, ..., head_h) W^O,    d_k = d_v = d_model / h

Masks follow `torch.nn.functional.scaled_dot_product_attention`: a boolean mask is True where a query
may attend a key, a float mask is added to the scores, and either broadcasts to (..., n, m).
`is_causal=True` lets query i see keys j <= i, aligned at the top-left corner as in torch, also when
n != m. A query whose keys are all masked gets a zero output row and zero weights, never NaN.

Grouped-query attention (Ainslie et al. 2023): keys and values may carry H_kv heads where H_kv divides
the H query heads; query head h reads key/value head h // (H / H_kv).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks

if TYPE_CHECKING:
    from .kv_cache import KVCache
    from .rope import RotaryEmbedding

BACKENDS = ("auto", "math", "sdpa", "flash")


# ----------------------------------------------------------------------------- validation

def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_min_rank(name, x, 2, "(..., seq_len, head_dim)")
        _checks.check_floating(name, x)
    _checks.check_same_dtype_device(q=q, k=k, v=v)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have the same last dimension d_k as q ({q.shape[-1]}), "
                         f"got k of shape {tuple(k.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k (..., m, d_k) and v (..., m, d_v) must agree on all but the last "
                         f"dimension, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.dim() != k.dim():
        raise ValueError(f"q and k must have the same rank, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        if q.shape[-3] % k.shape[-3] != 0:
            raise ValueError(f"k/v heads ({k.shape[-3]}) must divide q heads ({q.shape[-3]}) "
                             f"for grouped-query attention; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    batch_q, batch_k = q.shape[:-3], k.shape[:-3]
    if batch_q != batch_k:
        raise ValueError(f"q and k must share their batch dimensions, got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")


def _check_mask(mask: Tensor | None, scores_shape: tuple[int, ...], device: torch.device,
                scores_doc: str = "(..., n, m)") -> None:
    if mask is None:
        return
    _checks.check_tensor("mask", mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"mask must be boolean (True = may attend) or an additive float mask, "
                        f"got dtype {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but the inputs are on {device}")
    _checks.check_broadcastable("mask", mask, scores_shape, scores_doc)
    if mask.dim() > len(scores_shape):
        raise ValueError(f"mask has {mask.dim()} dimensions, more than the scores {scores_doc} "
                         f"of shape {scores_shape}")


def _scores_shape(q: Tensor, k: Tensor) -> tuple[int, ...]:
    return (*q.shape[:-1], k.shape[-2])


def _check_options(dropout_p: float, scale: float | None) -> None:
    _checks.check_probability("dropout_p", dropout_p)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not 0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")


# ----------------------------------------------------------------------------- masks

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


def _combined_mask(mask: Tensor | None, is_causal: bool, n: int, m: int, dtype: torch.dtype,
                   device: torch.device) -> Tensor | None:
    """One mask from the user's mask and the causal flag; float masks are cast to the scores' dtype."""
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    if not is_causal:
        return mask
    causal = causal_mask(n, m, device=device)
    return causal if mask is None else _and_masks(mask, causal)


def _expand_kv_heads(q: Tensor, x: Tensor) -> Tensor:
    """(..., H_kv, m, d) -> (..., H, m, d) by repeating each key/value head H / H_kv times."""
    if x.dim() < 3 or x.shape[-3] == q.shape[-3]:
        return x
    return x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3)


# ----------------------------------------------------------------------------- math path

def _masked_softmax(scores: Tensor) -> Tensor:
    """softmax over the last axis where a row of only -inf gives zeros (not NaN), gradients finite.

    softmax is invariant to shifting a row, so the row max is subtracted without a gradient; a row
    that is entirely -inf is shifted by 0 instead, so all its exponentials are 0. Every other row has
    at least one exp(0) = 1 term, so clamping the denominator at 1 changes nothing there.
    """
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)
    return exp / exp.sum(dim=-1, keepdim=True).clamp_min(1.0)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V, computed step by step.

    q: (..., n, d_k), k: (..., m, d_k), v: (..., m, d_v); scale defaults to 1/√d_k.
    Returns (output (..., n, d_v), weights (..., n, m)); the weights are those applied to V, so
    after dropout when dropout_p > 0. Rows with every key masked give zeros.
    """
    _check_qkv(q, k, v)
    _check_mask(mask, _scores_shape(q, k), q.device)
    _check_options(dropout_p, scale)
    return _math_attention(q, k, v, mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def _math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, dropout_p: float,
                    is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    k, v = _expand_kv_heads(q, k), _expand_kv_heads(q, v)
    n, m = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # why: scaling q costs d/m of scaling the scores; masking in place saves a copy (autograd keeps
    # q and k for the matmul's backward, not its output)
    scores = torch.matmul(q * scale, k.transpose(-2, -1))  # (..., n, m)
    every_row_sees_a_key = mask is None  # also when causal: query i sees key 0
    mask = _combined_mask(mask, is_causal, n, m, scores.dtype, scores.device)
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    # why: torch's softmax is one fused kernel; the guarded one is needed only for all-masked rows
    weights = torch.softmax(scores, dim=-1) if every_row_sees_a_key else _masked_softmax(scores)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.matmul(weights, v), weights  # (..., n, d_v), (..., n, m)


# ----------------------------------------------------------------------------- fused paths

def _sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, dropout_p: float,
                    is_causal: bool, scale: float | None) -> Tensor:
    """torch's fused kernel; it already zeroes fully masked rows. It refuses mask + is_causal, so
    those are combined first."""
    if mask is not None:
        mask = _combined_mask(mask, is_causal, q.shape[-2], k.shape[-2], q.dtype, q.device)
        is_causal = False
    gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=gqa)


def _key_padding_from_mask(mask: Tensor, q: Tensor, k: Tensor) -> Tensor | None:
    """A boolean mask of shape (B, 1, 1, m) or (B, m)-like is a key-padding mask: (B, m).

    Returns None when the mask is not of that form (it varies over heads or queries).
    """
    if mask.dtype != torch.bool or q.dim() != 4:
        return None
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    if shape[1] != 1 or shape[2] != 1:
        return None
    return mask.reshape(shape[0], shape[3]).expand(q.shape[0], k.shape[-2])


def _flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, dropout_p: float,
                     is_causal: bool, scale: float | None) -> Tensor:
    from .flash import flash_attention

    if dropout_p > 0.0:
        raise ValueError("backend='flash' does not apply attention dropout; use dropout_p=0 "
                         "or backend='sdpa'")
    if q.dim() != 4:
        raise ValueError(f"backend='flash' needs q, k, v of shape (B, H, n, d), got q {tuple(q.shape)}")
    key_padding_mask = None
    if mask is not None:
        key_padding_mask = _key_padding_from_mask(mask, q, k)
        if key_padding_mask is None:
            raise ValueError(f"backend='flash' takes only key-padding masks (boolean, broadcastable "
                             f"as (B, 1, 1, m)); got mask of shape {tuple(mask.shape)} and dtype "
                             f"{mask.dtype}")
    return flash_attention(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask, scale=scale)


def resolve_backend(backend: str, q: Tensor, k: Tensor, mask: Tensor | None, dropout_p: float) -> str:
    """The exact path `backend="auto"` takes.

    torch's fused kernel (sdpa) is the fastest exact path on CPU for fp32 and for long bf16 inputs, so
    auto picks it, except for bf16 with several queries and at most 512 keys (training a small GPT):
    there the math path is faster, forward + backward (e.g. B·H = 48, n = m = 256, d = 64: 41 vs 59 ms;
    n = m = 64, d = 32: 3.5 vs 11 ms, one core), and sdpa again from about 1024 keys on.
    On CUDA with a key-padding (or no) mask and no dropout, our Triton FlashAttention is used when
    triton is installed; otherwise sdpa again.
    """
    _checks.check_choice("backend", backend, BACKENDS)
    if backend != "auto":
        return backend
    if q.is_cuda and dropout_p == 0.0 and q.dim() == 4 and _triton_available() and (
            mask is None or _key_padding_from_mask(mask, q, k) is not None):
        return "flash"
    if not q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-2] > 1 and k.shape[-2] <= 512:
        return "math"
    return "sdpa"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_BACKEND_FUNCTIONS = {"sdpa": _sdpa_attention, "flash": _flash_attention}


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, is_causal: bool = False,
              backend: str = "auto", dropout_p: float = 0.0, scale: float | None = None) -> Tensor:
    """softmax(Q Kᵀ · scale + mask) V without returning the weights, so fused kernels may be used.

    Same shapes and mask semantics as `scaled_dot_product_attention`; backend is "math" (ours,
    step by step), "sdpa" (torch's fused kernel), "flash" (ours, O(n) memory; key-padding masks
    only) or "auto" (see `resolve_backend`).
    """
    _check_qkv(q, k, v)
    _check_mask(mask, _scores_shape(q, k), q.device)
    _check_options(dropout_p, scale)
    backend = resolve_backend(backend, q, k, mask, dropout_p)
    if backend == "math":
        return _math_attention(q, k, v, mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)[0]
    return _BACKEND_FUNCTIONS[backend](q, k, v, mask, dropout_p=dropout_p, is_causal=is_causal,
                                       scale=scale)


# ----------------------------------------------------------------------------- multi-head

class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The h per-head projections are stored together as one `nn.Linear` each: `W_q` (d_model -> h·d_k),
    `W_k` and `W_v` (d_model -> h_kv·d_k), `W_o` (h·d_k -> d_model), with d_k = d_model / h.
    n_kv_heads < n_heads gives grouped-query attention (n_kv_heads = 1: multi-query attention).
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None, bias: bool = True,
                 dropout: float = 0.0, backend: str = "auto"):
        super().__init__()
        _checks.check_positive_int("d_model", d_model)
        _checks.check_positive_int("n_heads", n_heads)
        _checks.check_divisible("d_model", d_model, "n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        _checks.check_positive_int("n_kv_heads", n_kv_heads)
        _checks.check_divisible("n_heads", n_heads, "n_kv_heads", n_kv_heads)
        _checks.check_probability("dropout", dropout)
        _checks.check_choice("backend", backend, BACKENDS)
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.dropout, self.backend = dropout, backend
        self.W_q = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.W_k = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.W_v = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.W_o = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)

    def split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        """(B, n, h·d_k) -> (B, h, n, d_k)."""
        batch, length, _ = x.shape
        return x.view(batch, length, n_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """K W^K and V W^V split into heads: (B, m, d_model) -> (B, h_kv, m, d_k) each."""
        return self.split_heads(self.W_k(key), self.n_kv_heads), self.split_heads(self.W_v(value), self.n_kv_heads)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, is_causal: bool = False,
                need_weights: bool = False, rope: RotaryEmbedding | None = None,
                kv_cache: KVCache | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """query (B, n, d_model), key and value (B, m, d_model) -> (B, n, d_model).

        mask: boolean (True = may attend) or additive float, of shape (n, m), (B, n, m) or
        broadcastable to (B, h, n, m). key_padding_mask: (B, m) boolean, True = real token.
        need_weights: also return the per-head weights (B, h, n, m) (the math path is used).
        rope: rotary embedding applied to queries and keys at their absolute positions.
        kv_cache: keys/values of earlier positions (self-attention decoding) or of a fixed memory
        (cross-attention); see `KVCache`. With a cache holding P positions, query i sits at
        position P + i and sees every key up to it when is_causal.
        """
        self._check_inputs(query, key, value)
        q = self.split_heads(self.W_q(query), self.n_heads)  # (B, h, n, d_k)
        offset = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None and kv_cache.static and kv_cache.length > 0:
            k, v = kv_cache.keys(), kv_cache.values()  # (B, h_kv, m, d_k)
            offset = 0
        else:
            k, v = self.project_kv(key, value)  # (B, h_kv, m, d_k)
            if rope is not None:
                k = rope(k, offset=offset)
            if kv_cache is not None:
                k, v = kv_cache.append(k, v)
        if rope is not None:
            q = rope(q, offset=offset)
        mask = self._attention_mask(mask, key_padding_mask, query, k)
        if is_causal and offset > 0:
            if q.shape[-2] > 1:  # a single newest query sees every key: no mask to build (decoding)
                causal = causal_mask(q.shape[-2], k.shape[-2], offset=offset, device=q.device)
                mask = causal if mask is None else _and_masks(mask, causal)
            is_causal = False
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = _math_attention(q, k, v, mask, dropout_p=dropout_p, is_causal=is_causal, scale=None)
        else:
            out = attention(q, k, v, mask, is_causal=is_causal, backend=self.backend, dropout_p=dropout_p)
        out = self.W_o(out.transpose(1, 2).reshape(query.shape[0], query.shape[1], -1))  # (B, n, d_model)
        return (out, weights) if need_weights else out

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        for name, x in (("query", query), ("key", key), ("value", value)):
            _checks.check_tensor(name, x, ndim=3, shape_doc="(B, seq_len, d_model)")
            _checks.check_floating(name, x)
            _checks.check_last_dim(name, x, self.d_model, "d_model")
        # dtypes may differ under autocast (a LayerNorm output in float32 meets a bf16 query)
        _checks.check_same_device(query=query, key=key, value=value)
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"key and value must have the same (B, m), got key {tuple(key.shape)} "
                             f"and value {tuple(value.shape)}")
        if query.shape[0] != key.shape[0]:
            raise ValueError(f"query and key must have the same batch size, got query "
                             f"{tuple(query.shape)} and key {tuple(key.shape)}")

    def _attention_mask(self, mask: Tensor | None, key_padding_mask: Tensor | None, query: Tensor,
                        k: Tensor) -> Tensor | None:
        """The user's masks as one mask broadcastable to (B, h, n, m)."""
        batch, n, m = query.shape[0], query.shape[1], k.shape[-2]
        if mask is not None:
            _checks.check_tensor("mask", mask, ndim=(2, 3, 4), shape_doc="(n, m), (B, n, m) or (B, h, n, m)")
            if mask.dim() == 3:
                mask = mask.unsqueeze(1)  # (B, 1, n, m)
            _check_mask(mask, (batch, self.n_heads, n, m), query.device, "(B, h, n, m)")
        if key_padding_mask is not None:
            _checks.check_tensor("key_padding_mask", key_padding_mask, ndim=2, shape_doc="(B, m)")
            if key_padding_mask.dtype != torch.bool:
                raise TypeError(f"key_padding_mask must be boolean (True = real token), "
                                f"got dtype {key_padding_mask.dtype}")
            if tuple(key_padding_mask.shape) != (batch, m):
                raise ValueError(f"key_padding_mask must have shape (B, m) = {(batch, m)}, "
                                 f"got {tuple(key_padding_mask.shape)}")
            padding = key_padding_mask[:, None, None, :]  # (B, 1, 1, m)
            mask = padding if mask is None else _and_masks(mask, padding)
        return mask


def _and_masks(mask: Tensor, allowed: Tensor) -> Tensor:
    """Restrict `mask` (boolean or additive) to the positions where boolean `allowed` is True."""
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))
