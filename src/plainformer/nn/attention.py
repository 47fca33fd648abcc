"""Scaled dot-product attention and multi-head attention (Vaswani et al. 2017, section 3.2).

    Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V,   Q: (..., n, d_k), K: (..., m, d_k), V: (..., m, d_v)

    head_i    = Attention(Q W_i^Q, K W_i^K, V W_i^V)
    MultiHead = Concat(head_1, ..., head_h) W^O,    d_k = d_v = d_model / h

Masks follow `torch.nn.functional.scaled_dot_product_attention`: a boolean mask is True where a query
may attend a key, a float mask is added to the scores, and either broadcasts to (..., n, m).
`is_causal=True` lets query i see keys j <= i, aligned at the top-left corner as in torch, also when
n != m. A query whose keys are all masked gets a zero output row and zero weights, never NaN.
Inside the layers the masks travel as one `AttentionMask` (see `masks`), combined once per batch.

Grouped-query attention (Ainslie et al. 2023): keys and values may carry H_kv heads where H_kv divides
the H query heads; query head h reads key/value head h // (H / H_kv).

The plain `MultiHeadAttention` computes these equations and nothing else. The variants that follow are
`VariantAttention`'s, each off by default, chosen once when the layer is built (a GPT's config builds one
where any is on):

QK-norm (Qwen3, OLMo 2; `qk_norm=True`): each head's query and key is RMS-normalised over d_k, with a
learned weight per feature, before the rotary embedding: q_h = RMSNorm(x W_h^Q), k_h = RMSNorm(x W_h^K).

Soft-capping (Gemma 2's attn_logit_softcapping; `softcap=c`): the scaled scores s = Q Kᵀ · scale become
c · tanh(s / c), bounded by ±c, before the mask is added and the softmax taken. torch's sdpa cannot
express it: `auto` takes another path, and backend="sdpa" with a softcap is refused.

ALiBi (Press et al. 2022; `alibi=True`): head h's score of query i for key j gets -m_h · (i - j), with the
slopes m_h of `positional.alibi_slopes`; the attention owns the slopes, the batch's `AttentionMask` adds
the bias (a dense additive mask for math and sdpa, the slopes themselves for flash).

Sliding-window attention (Mistral; `window=w`): query i sees only the last w positions, keys j with
i - w < j <= i; the batch's mask holds the window (a boolean mask for math and sdpa, the band itself for
flash, which skips the key blocks outside it), and a KV cache of the same window keeps only w positions.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from .masks import NO_MASK, AttentionMask, check_mask_tensor, check_masks, padded_positions
from .normalization import RMSNorm
from .positional import alibi_bias, alibi_slopes

if TYPE_CHECKING:
    from .kv_cache import KVCache
    from .rope import Rotation

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


def _scores_shape(q: Tensor, k: Tensor) -> tuple[int, ...]:
    return (*q.shape[:-1], k.shape[-2])


def _check_options(dropout_p: float, scale: float | None, softcap: float | None) -> None:
    _checks.check_probability("dropout_p", dropout_p)
    if scale is not None:
        _checks.check_positive_number("scale", scale)
    if softcap is not None:
        _checks.check_positive_number("softcap", softcap)


def check_softcap_backend(backend: str, field: str = "softcap") -> None:
    """A soft-cap needs a backend that computes it: torch's sdpa cannot (`field` names the argument)."""
    if backend == "sdpa":
        raise ValueError(f"{field} needs a backend that soft-caps the scores, and torch's sdpa cannot: "
                         "use backend='auto', 'math' or 'flash'")


def check_attention_args(d_model: int, n_heads: int, n_kv_heads: int | None, dropout: float, backend: str,
                         softcap: float | None = None) -> None:
    """`MultiHeadAttention`'s arguments, as its constructor checks them (and the layers, for theirs)."""
    _checks.check_positive_int("d_model", d_model)
    _checks.check_positive_int("n_heads", n_heads)
    _checks.check_divisible("d_model", d_model, "n_heads", n_heads)
    if n_kv_heads is not None:
        _checks.check_positive_int("n_kv_heads", n_kv_heads)
        _checks.check_divisible("n_heads", n_heads, "n_kv_heads", n_kv_heads)
    _checks.check_probability("dropout", dropout)
    _checks.check_choice("backend", backend, BACKENDS)
    if softcap is not None:
        _checks.check_positive_number("softcap", softcap)
        check_softcap_backend(backend)


# ----------------------------------------------------------------------------- heads

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
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V, computed step by step.

    q: (..., n, d_k), k: (..., m, d_k), v: (..., m, d_v); scale defaults to 1/√d_k.
    softcap c: the scores Q Kᵀ · scale become c · tanh(Q Kᵀ · scale / c) before the mask is added.
    Returns (output (..., n, d_v), weights (..., n, m)); the weights are those applied to V, so
    after dropout when dropout_p > 0. Rows with every key masked give zeros.
    """
    masks = _checked_masks(q, k, v, mask, is_causal, dropout_p, scale, softcap)
    return _math_attention(q, k, v, masks, dropout_p=dropout_p, scale=scale, softcap=softcap)


def _math_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, *, dropout_p: float,
                    scale: float | None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    k, v = _expand_kv_heads(q, k), _expand_kv_heads(q, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # why: scaling q costs d/m of scaling the scores; masking in place saves a copy (autograd keeps
    # q and k for the matmul's backward, not its output); an additive mask's gradient is the identity,
    # where masked_fill's costs a pass over the scores (on CPU the add is also several times faster:
    # docs/performance.md, "Choices inside the code")
    scores = torch.matmul(q * scale, k.transpose(-2, -1))  # (..., n, m)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)  # autograd keeps tanh's output: no in-place here
    additive = mask.additive_for(scores.dtype)
    if additive is not None:
        scores = scores.add_(additive)
    # why: torch's softmax is one fused kernel; the guarded one is needed only where a row may see
    # no key, which causality, ALiBi and a causal window never cause
    weights = torch.softmax(scores, dim=-1) if mask.rows_see_a_key else _masked_softmax(scores)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.matmul(weights, v), weights  # (..., n, d_v), (..., n, m)


# ----------------------------------------------------------------------------- fused paths

def _sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, *, dropout_p: float,
                    scale: float | None) -> Tensor:
    """torch's fused kernel; it already zeroes fully masked rows. It refuses a mask with is_causal,
    so anything beyond causality goes in as the dense mask."""
    gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    if mask.only_causal:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=mask.is_causal,
                                              scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense_for(q.dtype), dropout_p=dropout_p,
                                          scale=scale, enable_gqa=gqa)


def _flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, *, dropout_p: float,
                     scale: float | None, softcap: float | None) -> Tensor:
    from .flash import flash_attention

    if dropout_p > 0.0:
        raise ValueError("backend='flash' does not apply attention dropout; use dropout_p=0 "
                         "or backend='sdpa'")
    if q.dim() != 4:
        raise ValueError(f"backend='flash' needs q, k, v of shape (B, H, n, d), got q {tuple(q.shape)}")
    if mask.attn_mask is not None:
        raise ValueError(f"backend='flash' takes only key-padding masks (boolean, broadcastable "
                         f"as (B, 1, 1, m)); got mask of shape {tuple(mask.attn_mask.shape)} and dtype "
                         f"{mask.attn_mask.dtype}")
    out = flash_attention(q, k, v, is_causal=mask.is_causal, key_padding_mask=mask.key_padding, scale=scale,
                          offset=mask.offset, window=mask.window, softcap=softcap, alibi_slopes=mask.alibi)
    return cast(Tensor, out)  # without return_lse, the output alone


def resolve_backend(backend: str, q: Tensor, k: Tensor, mask: AttentionMask, dropout_p: float,
                    softcap: float | None = None) -> str:
    """The exact path `backend="auto"` takes.

    torch's fused kernel (sdpa) is the fastest exact path on CPU for fp32 and for long bf16 inputs, so
    auto picks it, except for bf16 with several queries and at most 512 keys (training a small GPT):
    there the math path is faster, forward + backward (e.g. B·H = 48, n = m = 256, d = 64: 41 vs 59 ms;
    n = m = 64, d = 32: 3.5 vs 11 ms, one core), and sdpa again from about 1024 keys on.
    On CUDA with a key-padding (or no) mask, top-left causality (if any) and no dropout, our Triton
    FlashAttention is used when triton is installed; otherwise sdpa again, with ALiBi and a sliding window
    in its mask. Soft-capped scores take the math path: neither sdpa nor the Triton kernel computes the cap.
    """
    if backend != "auto":
        return backend
    if softcap is not None:
        return "math"
    triton_takes = (mask.attn_mask is None and mask.alibi is None and mask.window is None
                    and (not mask.is_causal or mask.offset == 0))
    if q.is_cuda and dropout_p == 0.0 and q.dim() == 4 and triton_takes and _triton_available():
        return "flash"
    if not q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-2] > 1 and k.shape[-2] <= 512:
        return "math"
    return "sdpa"


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, *, backend: str,
               dropout_p: float, scale: float | None, softcap: float | None = None) -> Tensor:
    """softmax(Q Kᵀ · scale + mask) V on the backend `resolve_backend` picks; nothing is checked."""
    backend = resolve_backend(backend, q, k, mask, dropout_p, softcap)
    if backend == "math":
        return _math_attention(q, k, v, mask, dropout_p=dropout_p, scale=scale, softcap=softcap)[0]
    if backend == "sdpa":
        return _sdpa_attention(q, k, v, mask, dropout_p=dropout_p, scale=scale)
    return _flash_attention(q, k, v, mask, dropout_p=dropout_p, scale=scale, softcap=softcap)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, is_causal: bool = False,
              backend: str = "auto", dropout_p: float = 0.0, scale: float | None = None,
              softcap: float | None = None) -> Tensor:
    """softmax(Q Kᵀ · scale + mask) V without returning the weights, so fused kernels may be used.

    Same shapes and mask semantics as `scaled_dot_product_attention`; backend is "math" (ours,
    step by step), "sdpa" (torch's fused kernel; no softcap), "flash" (ours, O(n) memory; key-padding
    masks only) or "auto" (see `resolve_backend`).
    """
    _checks.check_choice("backend", backend, BACKENDS)
    masks = _checked_masks(q, k, v, mask, is_causal, dropout_p, scale, softcap)
    if softcap is not None:
        check_softcap_backend(backend)
    return _attention(q, k, v, masks, backend=backend, dropout_p=dropout_p, scale=scale, softcap=softcap)


def _checked_masks(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                   dropout_p: float, scale: float | None, softcap: float | None) -> AttentionMask:
    """Validate the functional API's arguments; its one mask as an `AttentionMask`."""
    _check_qkv(q, k, v)
    if mask is not None:
        check_mask_tensor("mask", mask, _scores_shape(q, k), q.device)
    _check_options(dropout_p, scale, softcap)
    n, m = q.shape[-2], k.shape[-2]
    key_padding = None if mask is None else _key_padding_from_mask(mask, q, k)
    if key_padding is not None:
        return AttentionMask.build(n, m, is_causal=is_causal, key_padding_mask=key_padding, device=q.device)
    return AttentionMask.build(n, m, is_causal=is_causal, attn_mask=mask, device=q.device)


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


# ----------------------------------------------------------------------------- multi-head

class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The h per-head projections are stored together as one `Linear` (a torch.nn.Linear) each: `W_q` (d_model -> h·d_k),
    `W_k` and `W_v` (d_model -> h_kv·d_k), `W_o` (h·d_k -> d_model), with d_k = d_model / h.
    n_kv_heads < n_heads gives grouped-query attention (n_kv_heads = 1: multi-query attention).

    `forward` checks its arguments and combines the masks (`mask_for`), unless it is handed the batch's
    `AttentionMask` (as the layers do), then takes one of two paths: `attend` (self-attention, or
    cross-attention over a memory projected on the spot; with a KV cache, the new positions join it) or
    `attend_memory` (cross-attention over a memory projected once, a static cache).

    This is the paper's attention. The variants of the module docstring are `VariantAttention`'s:
    `MultiHeadAttention(...)` given any of their keywords (qk_norm, norm_eps, softcap, alibi, window)
    builds one, as `pathlib.Path(...)` builds a `PosixPath`.

    validate_args=False (as in torch.distributions) skips the checks of the arguments: for a module
    built from a config that checked them already (a model's), or by a layer that did.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> MultiHeadAttention:
        chosen = VariantAttention if cls is MultiHeadAttention and kwargs.keys() & VARIANT_OPTIONS else cls
        return super().__new__(chosen)

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None, bias: bool = True,
                 dropout: float = 0.0, backend: str = "auto", validate_args: bool = True):
        super().__init__()
        if validate_args:
            check_attention_args(d_model, n_heads, n_kv_heads, dropout, backend)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
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

    def project_q(self, query: Tensor) -> Tensor:
        """Q W^Q split into heads: (B, n, d_model) -> (B, h, n, d_k)."""
        return self.split_heads(self.W_q(query), self.n_heads)

    def project_k(self, key: Tensor) -> Tensor:
        """K W^K split into heads: (B, m, d_model) -> (B, h_kv, m, d_k)."""
        return self.split_heads(self.W_k(key), self.n_kv_heads)

    def project_v(self, value: Tensor) -> Tensor:
        """V W^V split into heads: (B, m, d_model) -> (B, h_kv, m, d_k)."""
        return self.split_heads(self.W_v(value), self.n_kv_heads)

    def project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """K W^K and V W^V split into heads: (B, m, d_model) -> (B, h_kv, m, d_k) each."""
        return self.project_k(key), self.project_v(value)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | AttentionMask | None = None, *,
                key_padding_mask: Tensor | None = None, is_causal: bool = False, need_weights: bool = False,
                rope: Rotation | None = None, kv_cache: KVCache | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """query (B, n, d_model), key and value (B, m, d_model) -> (B, n, d_model).

        mask: boolean (True = may attend) or additive float, of shape (n, m), (B, n, m) or
        broadcastable to (B, h, n, m). key_padding_mask: (B, m) boolean, True = real token.
        Or mask is the batch's `AttentionMask` (what the layers pass): then nothing is checked, and
        key_padding_mask and is_causal are left out, being in it already.
        need_weights: also return the per-head weights (B, h, n, m) (the math path is used).
        rope: rotary embedding applied to queries and keys at their absolute positions.
        kv_cache: keys/values of earlier positions (self-attention decoding) or of a fixed memory
        (cross-attention, a static cache, filled from key and value on the first call); see
        `KVCache`. With a cache holding P positions, query i sits at position P + i and sees every
        key up to it when is_causal.
        """
        if not isinstance(mask, AttentionMask):
            mask = self.mask_for(query, key, value, mask, key_padding_mask=key_padding_mask,
                                 is_causal=is_causal, rope=rope, kv_cache=kv_cache)
        if kv_cache is not None and kv_cache.static:
            if kv_cache.length == 0:
                kv_cache.append(*self.project_kv(key, value))
            return self.attend_memory(query, kv_cache, mask, need_weights=need_weights)
        return self.attend(self.project_q(query), self.project_k(key), self.project_v(value), mask, rope=rope,
                           kv_cache=kv_cache, need_weights=need_weights)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask = NO_MASK, *, rope: Rotation | None = None,
               kv_cache: KVCache | None = None, need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """The heads q (B, h, n, d_k), k and v (B, h_kv, n', d_k), projected from new positions P .. P+n'-1
        (P = the positions in kv_cache, or 0) -> (B, n, d_model). With a cache, k and v join it, and the
        queries attend to the m = `kv_cache.attended(n')` keys it returns: all P + n', or a window's last;
        `mask` is built for n queries over those m keys (`AttentionMask.build` with cached=m - n)."""
        offset = 0 if kv_cache is None else kv_cache.length
        if rope is not None:
            q, k = rope(q, offset=offset), rope(k, offset=offset)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, h_kv, m, d_k)
        return self._attend(q, k, v, mask, need_weights)

    def attend_memory(self, query: Tensor, memory: KVCache, mask: AttentionMask = NO_MASK, *,
                      need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Cross-attention over a memory whose keys and values were projected once (a static cache)."""
        q = self.project_q(query)  # (B, h, n, d_k)
        return self._attend(q, memory.keys(), memory.values(), mask, need_weights)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask,
                need_weights: bool) -> Tensor | tuple[Tensor, Tensor]:
        """Attention per head, then Concat(head_1, ..., head_h) W^O: (B, h, n, d_k) -> (B, n, d_model)."""
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = _math_attention(q, k, v, mask, dropout_p=dropout_p, scale=None)
            return self.merge_heads(out), weights
        return self.merge_heads(_attention(q, k, v, mask, backend=self.backend, dropout_p=dropout_p, scale=None))

    def merge_heads(self, heads: Tensor) -> Tensor:
        """Concat(head_1, ..., head_h) W^O: (B, h, n, d_k) -> (B, n, d_model)."""
        batch, _, n, _ = heads.shape
        return self.W_o(heads.transpose(1, 2).reshape(batch, n, -1))

    # ------------------------------------------------------------------ masks

    def mask_for(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None, *,
                 key_padding_mask: Tensor | None = None, is_causal: bool = False,
                 rope: Rotation | None = None, kv_cache: KVCache | None = None) -> AttentionMask:
        """Validate `forward`'s arguments (shapes, dtypes, devices: nothing is read from a tensor)
        and combine the masks into the `AttentionMask` the paths take."""
        self._check_inputs(query, key, value, rope, kv_cache)
        cached, m = 0, key.shape[1]  # m: the keys attended, cached ones included
        if kv_cache is not None and kv_cache.static:
            m = kv_cache.length or m  # a filled memory cache is used as it is
        elif kv_cache is not None:
            m = kv_cache.attended(m)  # a window's cache attends the last of its positions only
            cached = m - key.shape[1]
        batch, n = query.shape[:2]
        attn_mask = check_masks(batch, self.n_heads, n, m, query.device, attn_mask=mask,
                                key_padding_mask=key_padding_mask)
        return self.combine_masks(n, m, is_causal=is_causal, cached=cached, key_padding_mask=key_padding_mask,
                                  attn_mask=attn_mask, device=query.device)

    def combine_masks(self, n: int, m: int, **constraints: Any) -> AttentionMask:
        """The `AttentionMask` of n queries over m keys under `constraints` (`AttentionMask.build`'s)."""
        return AttentionMask.build(n, m, **constraints)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor, rope: Rotation | None,
                      kv_cache: KVCache | None) -> None:
        for name, x in (("query", query), ("key", key), ("value", value)):
            _checks.check_tensor(name, x, ndim=3, shape_doc="(B, seq_len, d_model)")
            _checks.check_floating(name, x)
            _checks.check_last_dim(name, x, self.d_model, "d_model")
        # dtypes may differ under autocast (a LayerNorm output in float32 meets a bf16 query)
        weight = getattr(self.W_q, "weight", None)  # an int8 layer (inference/quantize.py) takes any float input
        if weight is not None and not torch.is_autocast_enabled(query.device.type):
            for name, x in (("query", query), ("key", key), ("value", value)):
                if x.dtype != weight.dtype:
                    raise TypeError(f"{name} is {x.dtype} but the layer's weights are {weight.dtype}: convert "
                                    f"one to the other (e.g. layer.to({x.dtype})) or run under torch.autocast")
        _checks.check_same_device(query=query, key=key, value=value)
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"key and value must have the same (B, m), got key {tuple(key.shape)} "
                             f"and value {tuple(value.shape)}")
        if query.shape[0] != key.shape[0]:
            raise ValueError(f"query and key must have the same batch size, got query "
                             f"{tuple(query.shape)} and key {tuple(key.shape)}")
        if kv_cache is not None and not (kv_cache.static and kv_cache.length):
            kv_cache.check_fits("k", (key.shape[0], self.n_kv_heads, key.shape[1], self.head_dim))
        if kv_cache is not None:
            self._check_cache_window(kv_cache)
        if rope is not None:
            check_rope(rope, self.head_dim, 0 if kv_cache is None or kv_cache.static else kv_cache.length,
                       query.shape[1])

    def _check_cache_window(self, kv_cache: KVCache) -> None:
        """A cache that keeps only a window's positions cannot serve an attention that sees them all."""
        if kv_cache.window is not None:
            raise ValueError(f"kv_cache keeps a window of {kv_cache.window} positions but this attention sees "
                             "every position: build the cache without a window")


def check_rope(rope: Rotation, head_dim: int, offset: int, length: int) -> None:
    """`rope` rotates heads of head_dim and has positions offset .. offset+length-1."""
    if rope.head_dim != head_dim:
        raise ValueError(f"rope has head_dim = {rope.head_dim} but the attention heads have "
                         f"head_dim = {head_dim}")
    _checks.check_positions("the rotated positions", offset, length, rope.max_len)


# ----------------------------------------------------------------------------- the variants

# The keywords that make `MultiHeadAttention(...)` a `VariantAttention`.
VARIANT_OPTIONS = frozenset({"qk_norm", "norm_eps", "softcap", "alibi", "window"})


class VariantAttention(MultiHeadAttention):
    """`MultiHeadAttention` with the variants of the module docstring, each off by default:

        qk_norm     `q_norm` and `k_norm`, RMSNorm over d_k (eps norm_eps, one weight shared by the heads, as
                    Qwen3's `self_attn.q_norm` / `k_norm`), applied to each head's query and key before rope
        softcap c   the scaled scores bounded by c · tanh(s / c) (Gemma 2), on every path but sdpa
        alibi       ALiBi's biases -m_h · (i - j) of self-attention: the slopes are the buffer `alibi_slopes`
                    (h,), not saved
        window w    query i sees only keys j > i - w (with is_causal, the last w positions); a KV cache handed
                    to it must keep the same window or none

    The slopes and the window enter the masks this attention builds (`mask_for`; `causal_mask` and
    `padded_mask`, which a `models.gpt.VariantGPT` calls once per batch for all its blocks). `forward` also
    takes `values`: self-attention's values already projected, which the value residual mixes
    (`models.gpt.VariantBlock`).
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None, bias: bool = True,
                 dropout: float = 0.0, backend: str = "auto", qk_norm: bool = False, norm_eps: float = 1e-6,
                 softcap: float | None = None, alibi: bool = False, window: int | None = None,
                 validate_args: bool = True):
        if validate_args:
            check_attention_args(d_model, n_heads, n_kv_heads, dropout, backend, softcap)
            if window is not None:
                _checks.check_positive_int("window", window)
            if qk_norm:
                _checks.check_positive_number("norm_eps", norm_eps)
        super().__init__(d_model, n_heads, n_kv_heads=n_kv_heads, bias=bias, dropout=dropout, backend=backend,
                         validate_args=False)
        self.softcap, self.window = softcap, window
        self.q_norm = RMSNorm(self.head_dim, eps=norm_eps, validate_args=False) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=norm_eps, validate_args=False) if qk_norm else None
        self.alibi_slopes: Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes(n_heads) if alibi else None, persistent=False)

    def split_heads(self, x: Tensor, n_heads: int, norm: nn.Module | None = None) -> Tensor:
        """(B, n, h·d_k) -> (B, h, n, d_k), each head normalised by `norm` over d_k when given."""
        if norm is None:
            return super().split_heads(x, n_heads)
        batch, length, _ = x.shape
        heads = x.view(batch, length, n_heads, self.head_dim)  # (B, n, h, d_k)
        # Back to the projection's dtype: under bf16 autocast the norm's float32 weight would promote the
        # queries and keys to float32, and attention would then run on float32 scores beside bf16 values.
        return norm(heads).to(heads.dtype).transpose(1, 2)

    def project_q(self, query: Tensor) -> Tensor:
        """Q W^Q split into heads, QK-normed where qk_norm: (B, n, d_model) -> (B, h, n, d_k)."""
        return self.split_heads(self.W_q(query), self.n_heads, self.q_norm)

    def project_k(self, key: Tensor) -> Tensor:
        """K W^K split into heads, QK-normed where qk_norm: (B, m, d_model) -> (B, h_kv, m, d_k)."""
        return self.split_heads(self.W_k(key), self.n_kv_heads, self.k_norm)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | AttentionMask | None = None, *,
                key_padding_mask: Tensor | None = None, is_causal: bool = False, need_weights: bool = False,
                rope: Rotation | None = None, kv_cache: KVCache | None = None,
                values: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """`MultiHeadAttention.forward`; values (B, h_kv, m, d_k): self-attention's values already projected,
        attended in place of value W^V (the value residual's mix of this layer's and the first layer's)."""
        if values is None:
            return super().forward(query, key, value, mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
                                   need_weights=need_weights, rope=rope, kv_cache=kv_cache)
        if not isinstance(mask, AttentionMask):
            mask = self.mask_for(query, key, value, mask, key_padding_mask=key_padding_mask,
                                 is_causal=is_causal, rope=rope, kv_cache=kv_cache)
        return self.attend(self.project_q(query), self.project_k(key), values, mask, rope=rope, kv_cache=kv_cache,
                           need_weights=need_weights)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask,
                need_weights: bool) -> Tensor | tuple[Tensor, Tensor]:
        """`MultiHeadAttention._attend` with the scores soft-capped where softcap."""
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = _math_attention(q, k, v, mask, dropout_p=dropout_p, scale=None, softcap=self.softcap)
            return self.merge_heads(out), weights
        return self.merge_heads(_attention(q, k, v, mask, backend=self.backend, dropout_p=dropout_p, scale=None,
                                           softcap=self.softcap))

    def combine_masks(self, n: int, m: int, **constraints: Any) -> AttentionMask:
        """`MultiHeadAttention.combine_masks` with this attention's window and ALiBi slopes."""
        return AttentionMask.build(n, m, window=self.window, alibi=self.alibi_slopes, **constraints)

    def causal_mask(self, n: int, m: int, *, device: torch.device | None = None) -> AttentionMask:
        """`AttentionMask.causal` (n queries at the last n of m positions, each seeing itself and the keys
        before it) with this attention's window and ALiBi slopes."""
        return self.combine_masks(n, m, is_causal=True, cached=m - n, device=device)

    def padded_mask(self, real: Tensor, cached: int = 0, *, keys: int | None = None) -> tuple[Tensor, AttentionMask]:
        """`masks.padded_positions_and_mask` (real (B, P + n), True = real token -> each row's positions (B, n)
        and its causal mask) with the window and ALiBi at each row's own positions: query i sees key j if
        j > i - window; the bias is -m_h · (i - j)."""
        positions, key_positions, allowed = padded_positions(real, cached, keys=keys)  # (B, n), (B, m), (B, 1, n, m)
        if self.window is not None:  # exact after padded_positions lets a query see itself: itself is in its window
            allowed = allowed & (key_positions[:, None, None, :] > positions[:, None, :, None] - self.window)
        n, m = allowed.shape[-2:]
        if self.alibi_slopes is None:
            return positions, AttentionMask.build(n, m, attn_mask=allowed, device=real.device)
        bias = alibi_bias(self.alibi_slopes, positions, key_positions).masked_fill(~allowed, float("-inf"))
        return positions, AttentionMask.build(n, m, attn_mask=bias, device=real.device)  # bias: (B, h, n, m)

    def _check_cache_window(self, kv_cache: KVCache) -> None:
        if kv_cache.window not in (None, self.window):
            raise ValueError(f"kv_cache keeps a window of {kv_cache.window} positions but this attention's window "
                             f"is {self.window}: build the cache with window={self.window}")
