"""Attention against torch: F.scaled_dot_product_attention for the functions, nn.MultiheadAttention
(with copied weights) for MultiHeadAttention; float64 gradcheck; property tests on the weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import plainformer as pf
from plainformer.nn.attention import VariantAttention, resolve_backend
from tests.reference.torch_reference import (
    assert_close,
    attention_parameter_grads,
    input_and_parameter_grads,
    load_torch_attention,
    randomize_biases,
    upstream_like,
)

B, H, D_K, D_V = 2, 2, 8, 6
LENGTHS = [(4, 4), (3, 5), (5, 3)]  # (n, m): self-attention shape, then n < m and n > m
MASKS = ["none", "bool", "additive", "causal", "padding", "causal+padding"]


def _ours(impl: str):
    """The function under test as (q, k, v, mask, **options) -> output."""
    if impl == "scaled_dot_product_attention":
        return lambda q, k, v, mask, **kw: pf.scaled_dot_product_attention(q, k, v, mask, **kw)[0]
    return lambda q, k, v, mask, **kw: pf.attention(q, k, v, mask, backend=impl, **kw)


IMPLS = ["scaled_dot_product_attention", "math", "sdpa", "auto"]


def _qkv(n: int, m: int, dtype: torch.dtype, *, heads: int = H, kv_heads: int = H,
         seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, heads, n, D_K, generator=g, dtype=dtype),
            torch.randn(B, kv_heads, m, D_K, generator=g, dtype=dtype),
            torch.randn(B, kv_heads, m, D_V, generator=g, dtype=dtype))


def _padding(m: int) -> Tensor:
    """(B, 1, 1, m), True = real key: batch 0 unpadded, batch 1 with its last two keys padded."""
    keep = torch.ones(B, 1, 1, m, dtype=torch.bool)
    keep[1, ..., m - 2:] = False
    return keep


def _mask_case(kind: str, n: int, m: int, dtype: torch.dtype) -> tuple[Tensor | None, bool, Tensor | None]:
    """(our mask, is_causal, torch's attn_mask). torch's mask states the causal part explicitly,
    built with tril rather than our causal_mask, so the reference stays independent."""
    g = torch.Generator().manual_seed(1)
    allowed = torch.rand(B, 1, n, m, generator=g) < 0.6
    allowed[..., torch.arange(n), torch.arange(n) % m] = True  # every query keeps a key
    tril = torch.ones(n, m, dtype=torch.bool).tril()
    if kind == "none":
        return None, False, None
    if kind == "bool":
        return allowed, False, allowed
    if kind == "additive":
        additive = torch.randn(n, m, generator=g, dtype=dtype).masked_fill(~allowed[0, 0], float("-inf"))
        return additive, False, additive
    if kind == "causal":
        return None, True, tril
    if kind == "padding":
        return _padding(m), False, _padding(m)
    return _padding(m), True, _padding(m) & tril


def _forward_backward(fn, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> list[Tensor]:
    """[output, dq, dk, dv] for the loss <output, G> with a fixed random G."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **kwargs)
    return [out, *torch.autograd.grad(out, (q, k, v), upstream_like(out))]


def _torch_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, **kwargs) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


# ----------------------------------------------------------------------------- functions vs torch

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,m", LENGTHS)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_torch_sdpa_outputs_and_gradients(impl, kind, n, m, dtype):
    q, k, v = _qkv(n, m, dtype)
    mask, is_causal, reference_mask = _mask_case(kind, n, m, dtype)
    ours = _forward_backward(_ours(impl), q, k, v, mask=mask, is_causal=is_causal)
    theirs = _forward_backward(_torch_sdpa, q, k, v, mask=reference_mask)
    for name, a, b in zip(("output", "dq", "dk", "dv"), ours, theirs, strict=True):
        assert_close(a, b, name)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_torch_sdpa_with_explicit_scale(impl):
    q, k, v = _qkv(3, 5, torch.float64)
    ours = _forward_backward(_ours(impl), q, k, v, mask=None, scale=0.3)
    theirs = _forward_backward(_torch_sdpa, q, k, v, mask=None, scale=0.3)
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["none", "causal", "padding"])
@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_query_attention_equals_repeated_kv_heads(impl, kind, dtype):
    """H_kv = 2 key/value heads serve H = 4 query heads: head h reads kv head h // 2."""
    n, m = 3, 5
    q, k, v = _qkv(n, m, dtype, heads=4, kv_heads=2)
    mask, is_causal, reference_mask = _mask_case(kind, n, m, dtype)

    def repeated(q, k, v, mask):
        return _torch_sdpa(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), mask)

    ours = _forward_backward(_ours(impl), q, k, v, mask=mask, is_causal=is_causal)
    theirs = _forward_backward(repeated, q, k, v, mask=reference_mask)
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("kind", MASKS)
def test_weights_are_the_masked_softmax_of_scaled_scores(kind):
    n, m = 3, 5
    q, k, v = _qkv(n, m, torch.float64)
    mask, is_causal, reference_mask = _mask_case(kind, n, m, torch.float64)
    out, weights = pf.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)
    scores = q @ k.transpose(-2, -1) / D_K ** 0.5
    if reference_mask is not None:
        scores = (scores.masked_fill(~reference_mask, float("-inf")) if reference_mask.dtype == torch.bool
                  else scores + reference_mask)
    expected = torch.softmax(scores, dim=-1)
    assert_close(weights, expected)
    assert_close(out, expected @ v)


def test_gradcheck_float64_math_and_sdpa():
    q, k, v = (x.requires_grad_() for x in _qkv(3, 4, torch.float64))
    mask = _padding(4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: pf.scaled_dot_product_attention(q, k, v, mask, is_causal=True), (q, k, v))
    for backend in ("math", "sdpa"):
        assert torch.autograd.gradcheck(
            lambda q, k, v, backend=backend: pf.attention(q, k, v, mask, backend=backend), (q, k, v))


def test_dropout_zeroes_weights_and_rescales_the_rest():
    q, k, v = _qkv(4, 4, torch.float64)
    torch.manual_seed(0)
    _, weights = pf.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    _, plain = pf.scaled_dot_product_attention(q, k, v)
    kept = weights != 0
    assert 0 < kept.float().mean() < 1
    assert_close(weights[kept], 2 * plain[kept])


# ----------------------------------------------------------------------------- properties

@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), m=st.integers(1, 6), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16),
       is_causal=st.booleans())
def test_weight_rows_sum_to_one_or_zero_when_fully_masked(n, m, density, seed, is_causal):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, length, 4, generator=g, dtype=torch.float64) for length in (n, m, m))
    mask = torch.rand(1, 2, n, m, generator=g) < density
    _, weights = pf.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)
    allowed = mask & torch.ones(n, m, dtype=torch.bool).tril() if is_causal else mask
    expected_sums = allowed.any(dim=-1).to(torch.float64)
    assert_close(weights.sum(dim=-1), expected_sums)
    assert (weights >= 0).all() and (weights[~allowed] == 0).all()


ALL_BACKENDS = ["math", "sdpa", "flash"]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_fully_masked_rows_give_zeros_and_finite_gradients(backend, is_causal):
    """Batch 1 has every key padded: its output rows are 0, its q-gradient is 0, nothing is NaN."""
    device = "cuda" if backend == "flash" and torch.cuda.is_available() else "cpu"
    q, k, v = (x.to(device) for x in _qkv(4, 4, torch.float32))
    keep = torch.ones(B, 1, 1, 4, dtype=torch.bool, device=device)
    keep[1] = False
    out, dq, dk, dv = _forward_backward(lambda q, k, v: pf.attention(q, k, v, keep, is_causal=is_causal,
                                                                      backend=backend), q, k, v)
    for x in (out, dq, dk, dv):
        assert torch.isfinite(x).all()
    assert (out[1] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert out[0].abs().sum() > 0


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_fully_masked_query_row_is_zero_while_others_match_torch(impl, mask_dtype):
    """Query 1 of every head sees no key (all False, or all -inf in an additive mask); torch (2.5+)
    also returns zeros there."""
    q, k, v = _qkv(3, 5, torch.float32)
    allowed = torch.ones(3, 5, dtype=torch.bool)
    allowed[1] = False
    mask = allowed if mask_dtype == torch.bool else torch.zeros(3, 5).masked_fill(~allowed, float("-inf"))
    out, dq, dk, dv = _forward_backward(_ours(impl), q, k, v, mask=mask)
    for x in (out, dq, dk, dv):
        assert torch.isfinite(x).all()
    assert (out[..., 1, :] == 0).all() and (dq[..., 1, :] == 0).all()
    for a, b in zip((out, dq, dk, dv), _forward_backward(_torch_sdpa, q, k, v, mask=mask), strict=True):
        assert_close(a, b)


# ----------------------------------------------------------------------------- MultiHeadAttention

D_MODEL, N_HEADS = 8, 2


def _mha_pair(seed: int = 0, dtype: torch.dtype = torch.float64, backend: str = "auto"):
    """torch's nn.MultiheadAttention (random biases) and ours with its weights, in train mode, dropout 0."""
    torch.manual_seed(seed)
    theirs = nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True, dtype=dtype)
    randomize_biases(theirs, torch.Generator().manual_seed(seed))
    ours = pf.MultiHeadAttention(D_MODEL, N_HEADS, backend=backend).to(dtype)
    load_torch_attention(ours, theirs)
    return ours, theirs


def _mha_inputs(n: int, m: int, dtype: torch.dtype, self_attention: bool):
    g = torch.Generator().manual_seed(3)
    query = torch.randn(B, n, D_MODEL, generator=g, dtype=dtype, requires_grad=True)
    if self_attention:
        return query, query, query
    key = torch.randn(B, m, D_MODEL, generator=g, dtype=dtype, requires_grad=True)
    value = torch.randn(B, m, D_MODEL, generator=g, dtype=dtype, requires_grad=True)
    return query, key, value


def _mha_masks(kind: str, n: int, m: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Keyword arguments for ours and for torch. torch's boolean masks are True = ignore, ours
    True = attend, so each torch mask is the negation of ours; float masks are additive in both."""
    g = torch.Generator().manual_seed(4)
    padded = torch.zeros(B, m, dtype=torch.bool)
    padded[1, m - 2:] = True  # torch: True = padding
    blocked = torch.rand(n, m, generator=g) < 0.3
    blocked[:, 0] = False
    per_head = torch.rand(B, N_HEADS, n, m, generator=g) < 0.3
    per_head[..., 0] = False
    causal_blocked = torch.ones(n, m, dtype=torch.bool).triu(1)
    additive = torch.randn(n, m, generator=g, dtype=dtype)
    if kind == "none":
        return {}, {}
    if kind == "padding":
        return {"key_padding_mask": ~padded}, {"key_padding_mask": padded}
    if kind == "attn_mask":
        return {"mask": ~blocked}, {"attn_mask": blocked}
    if kind == "additive":
        return {"mask": additive}, {"attn_mask": additive}
    if kind == "batch":  # ours (B, n, m) for every head; torch's 3-D masks are (B·h, n, m)
        return {"mask": ~per_head[:, 0]}, {"attn_mask": per_head[:, 0].repeat_interleave(N_HEADS, dim=0)}
    if kind == "per_head":
        return {"mask": ~per_head}, {"attn_mask": per_head.reshape(B * N_HEADS, n, m)}
    if kind == "causal":
        return {"is_causal": True}, {"attn_mask": causal_blocked}
    return ({"mask": ~blocked, "key_padding_mask": ~padded, "is_causal": True},
            {"attn_mask": blocked | causal_blocked, "key_padding_mask": padded})


MHA_MASKS = ["none", "padding", "attn_mask", "additive", "batch", "per_head", "causal", "all"]


def _mha_grads(module, output: Tensor, inputs: tuple[Tensor, ...]) -> list[Tensor]:
    return input_and_parameter_grads(module, output, inputs, attention_parameter_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("kind", MHA_MASKS)
@pytest.mark.parametrize("self_attention", [True, False], ids=["self", "cross"])
def test_matches_torch_multihead_attention_with_copied_weights(self_attention, kind, backend, dtype):
    n, m = (5, 5) if self_attention else (3, 5)
    ours, theirs = _mha_pair(dtype=dtype, backend=backend)
    inputs = _mha_inputs(n, m, dtype, self_attention)
    our_kwargs, their_kwargs = _mha_masks(kind, n, m, dtype)
    for need_weights in (False, True):
        out = ours(*inputs, need_weights=need_weights, **our_kwargs)
        ref, ref_weights = theirs(*inputs, need_weights=need_weights, average_attn_weights=False,
                                  **their_kwargs)
        if need_weights:
            out, weights = out
            assert weights.shape == (B, N_HEADS, n, m)
            assert_close(weights, ref_weights, "per-head weights")
        assert_close(out, ref, "output")
        for i, (a, b) in enumerate(zip(_mha_grads(ours, out, inputs), _mha_grads(theirs, ref, inputs), strict=True)):
            assert_close(a, b, f"gradient {i}")


@pytest.mark.parametrize("self_attention", [True, False], ids=["self", "cross"])
def test_head_averaged_weights_match_torch(self_attention):
    n, m = (5, 5) if self_attention else (3, 5)
    ours, theirs = _mha_pair()
    inputs = _mha_inputs(n, m, torch.float64, self_attention)
    our_kwargs, their_kwargs = _mha_masks("all", n, m, torch.float64)
    _, weights = ours(*inputs, need_weights=True, **our_kwargs)
    _, averaged = theirs(*inputs, need_weights=True, average_attn_weights=True, **their_kwargs)
    assert_close(weights.mean(dim=1), averaged)


def test_matches_torch_in_eval_mode_without_grad():
    """nn.MultiheadAttention takes its fused fast path here, a second reference implementation."""
    ours, theirs = _mha_pair(dtype=torch.float32)
    ours.eval(), theirs.eval()
    x = torch.randn(B, 5, D_MODEL)
    padded = torch.zeros(B, 5, dtype=torch.bool)
    padded[1, 3:] = True
    with torch.no_grad():
        assert_close(ours(x, x, x, key_padding_mask=~padded),
                     theirs(x, x, x, key_padding_mask=padded, need_weights=False)[0])


def test_gradcheck_float64_multihead_attention():
    ours, _ = _mha_pair()
    query, key, value = _mha_inputs(3, 4, torch.float64, self_attention=False)
    keep = torch.ones(B, 4, dtype=torch.bool)
    keep[0, -1] = False
    assert torch.autograd.gradcheck(
        lambda q, k, v: ours(q, k, v, key_padding_mask=keep, is_causal=True), (query, key, value))


def test_grouped_query_mha_equals_full_mha_with_repeated_kv_projections():
    torch.manual_seed(0)
    grouped = pf.MultiHeadAttention(16, 4, n_kv_heads=2).double()
    full = pf.MultiHeadAttention(16, 4).double()
    with torch.no_grad():
        for name in ("W_q", "W_o"):
            getattr(full, name).load_state_dict(getattr(grouped, name).state_dict())
        for name in ("W_k", "W_v"):  # rows (h_kv, d_k) -> (h, d_k), each kv head serving 2 query heads
            source, target = getattr(grouped, name), getattr(full, name)
            target.weight.copy_(source.weight.view(2, 4, 16).repeat_interleave(2, dim=0).reshape(16, 16))
            target.bias.copy_(source.bias.view(2, 4).repeat_interleave(2, dim=0).reshape(16))
    x = torch.randn(B, 5, 16, dtype=torch.float64)
    assert_close(grouped(x, x, x, is_causal=True), full(x, x, x, is_causal=True))
    (out, weights), (ref, ref_weights) = (module(x, x, x, is_causal=True, need_weights=True)
                                          for module in (grouped, full))
    assert_close(out, ref)
    assert_close(weights, ref_weights)


# ----------------------------------------------------------------------------- KV cache and rope
# Cached against the full pass: two of our paths that differ only in summation order, so float64 (1e-10).

@pytest.mark.parametrize("prefill", [1, 3])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_decoding_with_kv_cache_and_rope_equals_the_full_causal_pass(n_kv_heads, prefill):
    """Feed `prefill` tokens at once, then one token at a time: each step sees the cached past."""
    torch.manual_seed(0)
    mha = pf.MultiHeadAttention(16, 4, n_kv_heads=n_kv_heads).double().eval()
    rope = pf.RotaryEmbedding(head_dim=4, max_len=8).double()
    x = torch.randn(B, 6, 16, dtype=torch.float64)
    full = mha(x, x, x, is_causal=True, rope=rope)
    cache = pf.KVCache(B, n_kv_heads, max_len=8, head_dim=4, dtype=torch.float64)
    steps = [x[:, :prefill]] + [x[:, t:t + 1] for t in range(prefill, 6)]
    decoded = torch.cat([mha(step, step, step, is_causal=True, rope=rope, kv_cache=cache) for step in steps], dim=1)
    assert cache.length == 6
    assert_close(decoded, full)


def test_static_cache_reuses_the_projected_memory_for_cross_attention():
    torch.manual_seed(0)
    mha = pf.MultiHeadAttention(16, 4).double().eval()
    memory, queries = torch.randn(B, 5, 16, dtype=torch.float64), torch.randn(B, 3, 16, dtype=torch.float64)
    keep = torch.ones(B, 5, dtype=torch.bool)
    keep[1, 3:] = False
    full = mha(queries, memory, memory, key_padding_mask=keep)
    cache = pf.KVCache(B, 4, max_len=5, head_dim=4, static=True, dtype=torch.float64)
    steps = [mha(queries[:, t:t + 1], memory, memory, key_padding_mask=keep, kv_cache=cache) for t in range(3)]
    assert cache.length == 5
    assert_close(torch.cat(steps, dim=1), full)


# ----------------------------------------------------------------------------- attention variants
@pytest.mark.parametrize("variant", [dict(qk_norm=True), dict(norm_eps=1e-3), dict(softcap=30.0), dict(alibi=True),
                                     dict(window=4)])
def test_a_variant_keyword_builds_a_variant_attention_and_none_the_papers(variant):
    plain, varied = pf.MultiHeadAttention(16, 4, n_kv_heads=2), pf.MultiHeadAttention(16, 4, n_kv_heads=2, **variant)
    assert type(plain) is pf.MultiHeadAttention and type(varied) is VariantAttention
    assert type(copy.deepcopy(varied)) is VariantAttention and type(copy.deepcopy(plain)) is pf.MultiHeadAttention
    assert list(varied.state_dict())[:8] == list(plain.state_dict())  # W_q, W_k, W_v, W_o: the same names


def test_a_plain_attention_refuses_a_cache_that_keeps_a_window():
    mha = pf.MultiHeadAttention(16, 4)
    x = torch.randn(B, 3, 16)
    with pytest.raises(ValueError, match="kv_cache keeps a window of 2 positions but this attention sees every "
                                         "position: build the cache without a window"):
        mha(x, x, x, is_causal=True, kv_cache=pf.KVCache(B, 4, max_len=9, head_dim=4, window=2))



def _rms_normed(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def test_qk_norm_rms_normalises_each_heads_query_and_key_over_d_k():
    """The float64 equation: q_h = RMSNorm(x W_h^Q) ⊙ γ_q, k_h = RMSNorm(x W_h^K) ⊙ γ_k, then torch's sdpa."""
    torch.manual_seed(0)
    mha = pf.MultiHeadAttention(16, 4, n_kv_heads=2, qk_norm=True, norm_eps=1e-3).double()
    with torch.no_grad():
        mha.q_norm.weight.normal_(1.0, 0.5), mha.k_norm.weight.normal_(1.0, 0.5)
    assert mha.q_norm.weight.shape == mha.k_norm.weight.shape == (4,)  # one d_k weight shared by the heads
    x = torch.randn(B, 5, 16, dtype=torch.float64)
    q = _rms_normed((x @ mha.W_q.weight.T + mha.W_q.bias).view(B, 5, 4, 4), mha.q_norm.weight, 1e-3)
    k = _rms_normed((x @ mha.W_k.weight.T + mha.W_k.bias).view(B, 5, 2, 4), mha.k_norm.weight, 1e-3)
    v = (x @ mha.W_v.weight.T + mha.W_v.bias).view(B, 5, 2, 4)
    heads = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
    expected = heads.transpose(1, 2).reshape(B, 5, 16) @ mha.W_o.weight.T + mha.W_o.bias
    for backend in ("math", "sdpa", "flash"):
        mha.backend = backend
        assert_close(mha(x, x, x, is_causal=True), expected, backend)


def test_qk_norm_under_bf16_autocast_keeps_queries_and_keys_in_the_projections_dtype():
    """The norms' float32 weights must not promote q and k to float32 beside bf16 values: attention then
    ran on float32 scores (the whole training step ~1.5x slower). The normed q equals the float32 norm
    rounded once to bf16."""
    torch.manual_seed(0)
    mha = pf.MultiHeadAttention(16, 4, qk_norm=True)
    x = torch.randn(B, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = mha.project_q(x)
        k, v = mha.project_kv(x, x)
        projected = mha.W_q(x)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    expected = _rms_normed(projected.float().view(B, 5, 4, 4), mha.q_norm.weight, 1e-6).to(torch.bfloat16)
    torch.testing.assert_close(q.transpose(1, 2), expected, rtol=0, atol=2 ** -7)


def _gemma2_attention(q: Tensor, k: Tensor, v: Tensor, additive: Tensor | None, softcap: float):
    """transformers' Gemma 2 eager attention (its attn_logit_softcapping): c·tanh(q kᵀ · d_k^-½ / c) + mask.
    It takes its softmax in float32 whatever the inputs' dtype: the comparisons are float32's (1e-5)."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False, head_dim=q.shape[-1])
    out, weights = eager_attention_forward(module, q, k, v, additive, softcap=softcap)
    return out.transpose(1, 2), weights  # its output is (B, n, h, d_v)


@pytest.mark.parametrize("impl, kind", [  # flash takes no additive mask
    (impl, kind) for impl in ("scaled_dot_product_attention", "math", "flash", "auto")
    for kind in ("none", "causal", "causal+padding", "additive") if (impl, kind) != ("flash", "additive")])
def test_softcap_equals_gemma2_eager_attention_outputs_and_gradients(impl, kind):
    n = m = 5
    q, k, v = _qkv(n, m, torch.float32, heads=4, kv_heads=2)
    q = 3 * q  # scores well beyond the cap, where tanh bends
    mask, is_causal, reference_mask = _mask_case(kind, n, m, torch.float32)
    additive = (None if reference_mask is None else reference_mask if reference_mask.dtype != torch.bool
                else torch.zeros(reference_mask.shape).masked_fill(~reference_mask, -torch.inf))
    ours = _forward_backward(_ours(impl), q, k, v, mask=mask, is_causal=is_causal, softcap=1.5)
    theirs = _forward_backward(lambda q, k, v: _gemma2_attention(q, k, v, additive, 1.5)[0], q, k, v)
    for name, a, b in zip(("output", "dq", "dk", "dv"), ours, theirs, strict=True):
        assert_close(a, b, name)
    if impl == "scaled_dot_product_attention":
        weights = pf.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, softcap=1.5)[1]
        assert_close(weights, _gemma2_attention(q, k, v, additive, 1.5)[1], "weights")


def test_a_soft_capped_multihead_attention_equals_the_capped_scores_of_every_backend():
    torch.manual_seed(0)
    x = 4 * torch.randn(B, 6, 16)
    outputs = {}
    for backend in ("math", "flash", "auto"):
        torch.manual_seed(1)
        mha = pf.MultiHeadAttention(16, 4, n_kv_heads=2, softcap=2.0, backend=backend)
        outputs[backend], weights = mha(x, x, x, is_causal=True), mha(x, x, x, is_causal=True, need_weights=True)[1]
    q = mha.split_heads(mha.W_q(x), 4)
    k, v = mha.project_kv(x, x)
    causal = torch.zeros(6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -torch.inf)
    heads, expected_weights = _gemma2_attention(q, k, v, causal, 2.0)
    expected = mha.W_o(heads.transpose(1, 2).reshape(B, 6, 16))
    for backend, out in outputs.items():
        assert_close(out, expected, backend)
    assert_close(weights, expected_weights, "weights")


def test_torch_sdpa_cannot_soft_cap_so_asking_for_both_is_refused_naming_the_field():
    q, k, v = _qkv(3, 3, torch.float32)
    with pytest.raises(ValueError, match="softcap needs a backend that soft-caps the scores, and torch's sdpa"):
        pf.attention(q, k, v, backend="sdpa", softcap=2.0)
    with pytest.raises(ValueError, match="softcap needs a backend"):
        pf.MultiHeadAttention(16, 4, backend="sdpa", softcap=2.0)
    with pytest.raises(ValueError, match="softcap must be"):
        pf.MultiHeadAttention(16, 4, softcap=0.0)
    with pytest.raises(ValueError, match="attn_softcap needs a backend"):
        pf.GPTConfig(backend="sdpa", attn_softcap=30.0)


def test_auto_takes_the_math_path_for_soft_capped_scores():
    q, k, v = _qkv(3, 3, torch.float32)
    assert resolve_backend("auto", q, k, pf.nn.AttentionMask(), 0.0) == "sdpa"
    assert resolve_backend("auto", q, k, pf.nn.AttentionMask(), 0.0, 30.0) == "math"


def _bloom_attention_with_our_weights(ours: pf.MultiHeadAttention):
    """transformers' BloomAttention with our W_q, W_k, W_v fused as its query_key_value, whose rows are
    (head, [q, k, v], d_k), and W_o as its dense."""
    import transformers
    from transformers.models.bloom.modeling_bloom import BloomAttention

    h, d = ours.n_heads, ours.head_dim
    config = transformers.BloomConfig(hidden_size=ours.d_model, n_head=h, attention_dropout=0.0, hidden_dropout=0.0)
    theirs = BloomAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for kind in ("weight", "bias"):
            parts = [getattr(linear, kind).view(h, d, -1) for linear in (ours.W_q, ours.W_k, ours.W_v)]
            getattr(theirs.query_key_value, kind).copy_(torch.stack(parts, dim=1).reshape(3 * h * d, -1).squeeze(-1))
        theirs.dense.load_state_dict(ours.W_o.state_dict())
    return theirs


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash", "auto"])
def test_alibi_attention_equals_bloom_attention_with_copied_weights(backend):
    """Bloom adds m_h · j (its `build_alibi_tensor`) where ALiBi's -m_h · (i - j) adds -m_h · i more: a
    constant of each query's row, which softmax cancels, so outputs and weights are equal."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    torch.manual_seed(0)
    ours = pf.MultiHeadAttention(24, 6, alibi=True, backend=backend).eval()
    theirs = _bloom_attention_with_our_weights(ours)
    x = 2 * torch.randn(B, 7, 24)
    real = torch.ones(B, 7, dtype=torch.bool)
    real[1, 5:] = False  # right padding: Bloom's positions (the real tokens' count) are the columns
    allowed = torch.ones(7, 7, dtype=torch.bool).tril() & real[:, None, None, :]
    additive = torch.zeros(B, 1, 7, 7).masked_fill(~allowed, -torch.inf)
    expected, expected_weights = theirs(x, torch.zeros_like(x), build_alibi_tensor(real, 6, torch.float32), additive)
    with torch.no_grad():
        assert_close(ours(x, x, x, key_padding_mask=real, is_causal=True), expected, "padded")
        out, weights = ours(x[:1], x[:1], x[:1], is_causal=True, need_weights=True)
        assert_close(ours(x[:1], x[:1], x[:1], is_causal=True), expected[:1], "output")
    assert_close(weights, expected_weights[:1], "weights")


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash", "auto"])
def test_a_windowed_attention_sees_the_last_w_positions_and_decodes_them_from_a_rolling_cache(backend):
    """Query i sees keys i - w < j <= i (torch's sdpa with that boolean mask, float64); decoding through a
    cache of the same window, which keeps only w positions, gives the same outputs."""
    torch.manual_seed(0)
    mha = pf.MultiHeadAttention(16, 4, n_kv_heads=2, window=3, backend=backend).double().eval()
    x = torch.randn(B, 9, 16, dtype=torch.float64)
    q = mha.split_heads(mha.W_q(x), 4)
    k, v = mha.project_kv(x, x)
    band = torch.ones(9, 9, dtype=torch.bool).tril() & ~torch.ones(9, 9, dtype=torch.bool).tril(-3)
    heads = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True)
    expected = mha.W_o(heads.transpose(1, 2).reshape(B, 9, 16))
    assert_close(mha(x, x, x, is_causal=True), expected, "full")
    cache = pf.KVCache(B, 2, max_len=9, head_dim=4, window=3, dtype=torch.float64)
    chunks = [(0, 2), (2, 3), (3, 4), (4, 8), (8, 9)]
    decoded = torch.cat([mha(x[:, a:b], x[:, a:b], x[:, a:b], is_causal=True, kv_cache=cache) for a, b in chunks], 1)
    assert cache.length == 9 and cache.keys().shape[2] == 3
    assert_close(decoded, expected, "decoded")
    with pytest.raises(ValueError, match="kv_cache keeps a window of 4 positions but this attention's window is 3"):
        mha(x, x, x, is_causal=True, kv_cache=pf.KVCache(B, 2, max_len=9, head_dim=4, window=4))
