"""FlashAttention in plain PyTorch against torch's scaled_dot_product_attention in float64."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from plainformer.nn.flash import flash_attention

LENGTHS = (1, 7, 64, 65, 200, 513)


def make_inputs(n: int, m: int, *, heads: int = 2, kv_heads: int = 2, batch: int = 2, dim: int = 8,
                dtype: torch.dtype = torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, m, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, m, dim, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(batch, heads, n, dim, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)] + [grad_out.to(dtype)]


def padding_mask(batch: int, m: int, seed: int = 1) -> torch.Tensor:
    """Random key padding (True = real token), at least one real key per sequence."""
    mask = torch.rand(batch, m, generator=torch.Generator().manual_seed(seed)) > 0.3
    mask[:, 0] = True
    return mask


def reference(q, k, v, *, is_causal=False, key_padding_mask=None, scale=None):
    """torch's scaled_dot_product_attention in float64 with an explicit boolean mask."""
    n, m = q.shape[2], k.shape[2]
    mask = torch.ones(n, m, dtype=torch.bool)
    mask = mask.tril() if is_causal else mask
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]  # (B, 1, n, m)
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out, (q, k, v)


def outputs_and_grads(q, k, v, grad_out, **kwargs):
    out = flash_attention(q, k, v, **kwargs)
    return [out, *torch.autograd.grad(out, (q, k, v), grad_out)]


def reference_outputs_and_grads(q, k, v, grad_out, *, block_q=None, block_k=None, **kwargs):
    out, leaves = reference(q, k, v, **kwargs)
    return [out, *torch.autograd.grad(out, leaves, grad_out.double())]


def max_error(ours, theirs):
    return max((a.double() - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("blocks", [(32, 64), (24, 40)], ids=["blocks32x64", "blocks24x40"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("is_causal,padded", list(itertools.product([False, True], repeat=2)),
                         ids=["plain", "padded", "causal", "causal+padded"])
def test_matches_sdpa_in_float64_over_lengths(blocks, kv_heads, is_causal, padded):
    for n, m in itertools.product(LENGTHS, repeat=2):
        q, k, v, grad_out = make_inputs(n, m, heads=4, kv_heads=kv_heads, batch=2, dim=4)
        kwargs = dict(is_causal=is_causal, key_padding_mask=padding_mask(2, m) if padded else None)
        ours = outputs_and_grads(q, k, v, grad_out, block_q=blocks[0], block_k=blocks[1], **kwargs)
        theirs = reference_outputs_and_grads(q, k, v, grad_out, **kwargs)
        assert max_error(ours, theirs) <= 1e-10, (n, m)


@pytest.mark.parametrize("is_causal,padded", list(itertools.product([False, True], repeat=2)))
def test_matches_sdpa_in_float32(is_causal, padded):
    for n, m in [(65, 200), (513, 64), (200, 513), (7, 65)]:
        q, k, v, grad_out = make_inputs(n, m, heads=4, kv_heads=2, dim=16, dtype=torch.float32)
        kwargs = dict(is_causal=is_causal, key_padding_mask=padding_mask(2, m) if padded else None)
        ours = outputs_and_grads(q, k, v, grad_out, block_q=48, block_k=64, **kwargs)
        theirs = reference_outputs_and_grads(q, k, v, grad_out, **kwargs)
        assert all(x.dtype == torch.float32 for x in ours)
        assert max_error(ours, theirs) <= 2e-5, (n, m)


@pytest.mark.parametrize("is_causal", [False, True])
def test_bfloat16_is_within_two_percent(is_causal):
    q, k, v, grad_out = make_inputs(200, 65, heads=4, kv_heads=2, dim=16, dtype=torch.bfloat16)
    kwargs = dict(is_causal=is_causal, key_padding_mask=padding_mask(2, 65))
    ours = outputs_and_grads(q, k, v, grad_out, block_q=64, block_k=48, **kwargs)
    theirs = reference_outputs_and_grads(q, k, v, grad_out, **kwargs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.double() - b).abs().max() <= 2e-2 * b.abs().max()


def test_default_blocks_and_scale_match_sdpa():
    q, k, v, grad_out = make_inputs(600, 1100, heads=4, kv_heads=1, batch=1)
    for kwargs in (dict(is_causal=True), dict(scale=0.3)):
        ours = outputs_and_grads(q, k, v, grad_out, **kwargs)
        assert max_error(ours, reference_outputs_and_grads(q, k, v, grad_out, **kwargs)) <= 1e-10


def test_gradcheck_in_float64_with_lse():
    q, k, v, _ = make_inputs(5, 7, heads=4, kv_heads=2, batch=2, dim=3)
    mask = torch.tensor([[True, False, True, True, False, True, True], [True] * 6 + [False]])

    def fn(q, k, v):
        return flash_attention(q, k, v, is_causal=True, key_padding_mask=mask, block_q=2,
                               block_k=3, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_lse_is_the_logsumexp_of_the_scores():
    q, k, v, _ = make_inputs(9, 13, heads=2, kv_heads=1)
    _, lse = flash_attention(q, k, v, block_q=4, block_k=5, return_lse=True)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # k broadcasts over the heads
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1), rtol=0, atol=1e-12)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v, grad_out = make_inputs(6, 5, heads=2, kv_heads=1)
    mask = torch.tensor([[False] * 5, [False, True, True, True, True]])
    out, lse = flash_attention(q, k, v, is_causal=True, key_padding_mask=mask, block_q=4, block_k=2,
                               return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    # Batch 0 has no real key; in batch 1 query 0 sees only key 0, which is padding.
    masked = torch.tensor([[True] * 6, [True] + [False] * 5])[:, None, :].expand(2, 2, 6)
    assert torch.equal(out[masked], torch.zeros_like(out[masked]))
    assert torch.equal(dq[masked], torch.zeros_like(dq[masked]))
    assert torch.isneginf(lse[masked]).all() and torch.isfinite(lse[~masked]).all()
    assert not dk[0].any() and not dv[0].any()
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_key_blocks_in_the_causal_future_are_skipped():
    """Keys at positions >= n lie in the future of every query: with block_k dividing n their
    blocks must never be touched. NaN values there would leak into O = P V (as 0 · NaN) if they
    were computed and masked instead."""
    n, m = 64, 200
    q, k, v, grad_out = make_inputs(n, m)
    with torch.no_grad():
        k[:, :, n:] = float("nan")
        v[:, :, n:] = float("nan")
    out, dq, dk, dv = outputs_and_grads(q, k, v, grad_out, is_causal=True, block_q=16, block_k=32)
    ref = reference_outputs_and_grads(q, k[:, :, :n], v[:, :, :n], grad_out, is_causal=True)
    assert max_error([out, dq, dk[:, :, :n], dv[:, :, :n]], ref) <= 1e-10
    assert torch.equal(dk[:, :, n:], torch.zeros_like(dk[:, :, n:]))


def test_non_contiguous_inputs_match_contiguous():
    q, k, v, grad_out = make_inputs(33, 17, heads=4, kv_heads=2)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                  for x in (q, k, v))
    mask = padding_mask(2, 34)[:, ::2]
    ours = outputs_and_grads(qt, kt, vt, grad_out, key_padding_mask=mask, block_q=8, block_k=8)
    theirs = reference_outputs_and_grads(q, k, v, grad_out, key_padding_mask=mask)
    assert max_error(ours, theirs) <= 1e-10


def peak_live_bytes(call) -> int:
    """Most bytes live at once in torch's CPU allocator during `call` (profiler memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        call()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("is_causal", [False, True])
def test_never_allocates_an_n_by_m_tensor(is_causal):
    n = m = 2048
    q, k, v, grad_out = make_inputs(n, m, heads=1, kv_heads=1, batch=1, dim=16, dtype=torch.float32)
    scores_bytes = n * m * 4  # 16 MiB; q, k, v, O and the default score tile are 128-512 KiB each
    mask = torch.ones(1, m, dtype=torch.bool)

    def forward():
        return flash_attention(q, k, v, is_causal=is_causal, key_padding_mask=mask)

    assert peak_live_bytes(forward) < scores_bytes / 8
    out = forward()
    assert peak_live_bytes(lambda: torch.autograd.grad(out, (q, k, v), grad_out)) < scores_bytes / 4
    # The check itself sees an n x m tensor when there is one.
    assert peak_live_bytes(lambda: reference(q, k, v, is_causal=is_causal)) >= scores_bytes


def test_importing_and_running_needs_no_triton():
    script = ("import sys; sys.modules['triton'] = None\n"
              "import torch, plainformer\n"
              "from plainformer.nn.flash import flash_attention\n"
              "q = torch.randn(1, 2, 5, 4, requires_grad=True)\n"
              "flash_attention(q, q, q, is_causal=True).sum().backward()\n"
              "assert torch.isfinite(q.grad).all()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- attention variants
# The reference is each variant's equation computed step by step in float64 in the test.

def variant_reference(q, k, v, *, is_causal=False, key_padding_mask=None, scale=None, offset=0, window=None,
                      softcap=None, alibi_slopes=None):
    """softmax(c·tanh(s·q kᵀ / c) + m_h·(j - i - offset), masked) v in float64, query i at key position
    i + offset seeing keys j > i + offset - window, a row without a visible key giving zeros; returns
    (out, (q, k, v) leaves)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    n, m = q.shape[2], k.shape[2]
    scores = q @ k.repeat_interleave(groups, dim=1).transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    distance = torch.arange(m)[None, :] - (torch.arange(n)[:, None] + offset)  # j - (i + offset), (n, m)
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.double()[:, None, None] * distance
    allowed = torch.ones(1, 1, n, m, dtype=torch.bool)
    if is_causal:
        allowed = allowed & (distance <= 0)
    if window is not None:
        allowed = allowed & (distance > -window)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    weights = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1).nan_to_num(0.0)
    return weights @ v.repeat_interleave(groups, dim=1), (q, k, v)


def variant_outputs_and_grads(q, k, v, grad_out, *, block_q=None, block_k=None, **kwargs):
    out, leaves = variant_reference(q, k, v, **kwargs)
    return [out, *torch.autograd.grad(out, leaves, grad_out.double())]


@pytest.mark.parametrize("blocks", [(32, 64), (24, 40)], ids=["blocks32x64", "blocks24x40"])
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("is_causal,padded", [(False, False), (True, True)], ids=["plain", "causal+padded"])
def test_softcap_matches_the_capped_scores_in_float64_over_lengths(blocks, kv_heads, is_causal, padded):
    for n, m in [(7, 65), (65, 200), (200, 64), (513, 513)]:
        q, k, v, grad_out = make_inputs(n, m, heads=4, kv_heads=kv_heads, batch=2, dim=4)
        kwargs = dict(is_causal=is_causal, key_padding_mask=padding_mask(2, m) if padded else None, softcap=0.7)
        ours = outputs_and_grads(q, k, v, grad_out, block_q=blocks[0], block_k=blocks[1], **kwargs)
        assert max_error(ours, variant_outputs_and_grads(q, k, v, grad_out, **kwargs)) <= 1e-10, (n, m)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])  # ALiBi's for 4 heads, exact in every dtype


@pytest.mark.parametrize("blocks", [(32, 64), (24, 40)], ids=["blocks32x64", "blocks24x40"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("is_causal,padded", [(False, False), (True, False), (True, True)],
                         ids=["plain", "causal", "causal+padded"])
def test_alibi_at_any_offset_matches_the_biased_scores_in_float64(blocks, kv_heads, is_causal, padded):
    for n, m in [(1, 65), (7, 65), (65, 200), (200, 64), (300, 300)]:
        for offset in sorted({0, 5, max(0, m - n)}):
            q, k, v, grad_out = make_inputs(n, m, heads=4, kv_heads=kv_heads, batch=2, dim=4)
            kwargs = dict(is_causal=is_causal, key_padding_mask=padding_mask(2, m) if padded else None,
                          offset=offset, alibi_slopes=SLOPES.double())
            ours = outputs_and_grads(q, k, v, grad_out, block_q=blocks[0], block_k=blocks[1], **kwargs)
            theirs = variant_outputs_and_grads(q, k, v, grad_out, **kwargs)
            assert max_error(ours, theirs) <= 1e-10, (n, m, offset)


def test_lse_holds_the_alibi_bias():
    q, k, v, _ = make_inputs(9, 13, heads=4, kv_heads=2)
    _, lse = flash_attention(q, k, v, offset=4, alibi_slopes=SLOPES.double(), block_q=4, block_k=5, return_lse=True)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 2 ** 1.5
    scores = scores + SLOPES.double()[:, None, None] * (torch.arange(13)[None, :] - torch.arange(4, 13)[:, None])
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1), rtol=0, atol=1e-12)


def test_key_blocks_past_the_shifted_diagonal_are_skipped():
    """Query i at key position i + offset: keys past n - 1 + offset are in every query's future."""
    n, m, offset = 32, 200, 32
    q, k, v, grad_out = make_inputs(n, m)
    with torch.no_grad():
        k[:, :, n + offset:] = float("nan")
        v[:, :, n + offset:] = float("nan")
    out, dq, dk, dv = outputs_and_grads(q, k, v, grad_out, is_causal=True, offset=offset, block_q=16, block_k=32)
    ref = variant_outputs_and_grads(q, k[:, :, :n + offset], v[:, :, :n + offset], grad_out, is_causal=True,
                                    offset=offset)
    assert max_error([out, dq, dk[:, :, :n + offset], dv[:, :, :n + offset]], ref) <= 1e-10


@pytest.mark.parametrize("blocks", [(32, 64), (24, 40), (16, 16)], ids=["blocks32x64", "blocks24x40", "blocks16"])
@pytest.mark.parametrize("window", [1, 17, 64])
@pytest.mark.parametrize("variant", ["causal", "causal+padded+alibi+softcap", "not-causal"])
def test_a_sliding_window_at_any_offset_matches_the_banded_scores_in_float64(blocks, window, variant):
    for n, m in [(1, 65), (7, 65), (65, 200), (200, 200), (300, 300)]:
        for offset in sorted({0, 5, max(0, m - n)}):
            q, k, v, grad_out = make_inputs(n, m, heads=4, kv_heads=2, batch=2, dim=4)
            kwargs = dict(is_causal=variant != "not-causal", offset=offset, window=window)
            if variant == "causal+padded+alibi+softcap":
                kwargs.update(key_padding_mask=padding_mask(2, m), alibi_slopes=SLOPES.double(), softcap=0.7)
            ours = outputs_and_grads(q, k, v, grad_out, block_q=blocks[0], block_k=blocks[1], **kwargs)
            theirs = variant_outputs_and_grads(q, k, v, grad_out, **kwargs)
            assert max_error(ours, theirs) <= 1e-10, (n, m, offset)


def test_key_blocks_before_every_window_are_skipped():
    """Queries at key positions 160 .. 191 with a window of 16 see keys 145 .. 191 only: the blocks of
    keys before 128 must never be touched (NaN there would leak into O as 0 · NaN)."""
    n, m, offset, window = 32, 192, 160, 16
    q, k, v, grad_out = make_inputs(n, m)
    with torch.no_grad():
        k[:, :, :128] = float("nan")
        v[:, :, :128] = float("nan")
    kwargs = dict(is_causal=True, offset=offset, window=window)
    out, dq, dk, dv = outputs_and_grads(q, k, v, grad_out, block_q=16, block_k=32, **kwargs)
    ref = variant_outputs_and_grads(q, k[:, :, 128:], v[:, :, 128:], grad_out, is_causal=True,
                                    offset=offset - 128, window=window)
    assert max_error([out, dq, dk[:, :, 128:], dv[:, :, 128:]], ref) <= 1e-10
    assert torch.equal(dk[:, :, :128], torch.zeros_like(dk[:, :, :128]))


def test_a_causal_window_costs_a_band_of_tiles_not_a_triangle(monkeypatch):
    """One q kᵀ product per tile computed: with a window w, each query block meets at most w / block_k + 2 key
    blocks, O(n·w) in all, where causal attention alone meets O(n²)."""
    n, block, window = 1024, 64, 64
    q, k, v, _ = make_inputs(n, n, heads=1, kv_heads=1, batch=1, dim=8, dtype=torch.float32)
    products = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *args, **kwargs: products.append(1) or real_bmm(*args, **kwargs))
    with torch.no_grad():
        flash_attention(q, k, v, is_causal=True, window=window, block_q=block, block_k=block)
        banded = len(products)
        products.clear()
        flash_attention(q, k, v, is_causal=True, block_q=block, block_k=block)
    blocks = n // block
    assert banded <= blocks * (window // block + 1)  # 2 per query block: the diagonal one and the one before
    assert len(products) == blocks * (blocks + 1) // 2


def test_gradcheck_in_float64_through_the_softcap():
    q, k, v, _ = make_inputs(5, 7, heads=4, kv_heads=2, batch=2, dim=3)
    q = (4 * q).detach().requires_grad_()  # scores beyond the cap
    mask = torch.tensor([[True, False, True, True, False, True, True], [True] * 6 + [False]])

    def fn(q, k, v):
        return flash_attention(q, k, v, is_causal=True, key_padding_mask=mask, softcap=1.3, block_q=2,
                               block_k=3, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_in_float64_through_the_alibi_bias_and_the_window_at_an_offset():
    q, k, v, _ = make_inputs(5, 7, heads=4, kv_heads=2, batch=2, dim=3)
    mask = torch.tensor([[True, False, True, True, False, True, True], [True] * 6 + [False]])

    def fn(q, k, v):
        return flash_attention(q, k, v, is_causal=True, key_padding_mask=mask, offset=2, window=3, softcap=1.3,
                               alibi_slopes=SLOPES.double(), block_q=2, block_k=3, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def _bad_inputs():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    return [
        ("q as list", (q.tolist(), k, v), {}, TypeError, "q must be a torch.Tensor"),
        ("q rank 3", (q[0], k, v), {}, ValueError, "q must have 4 dimensions"),
        ("k rank 5", (q, k[None], v), {}, ValueError, "k must have 4 dimensions"),
        ("int q", (q.long(), k, v), {}, TypeError, "q must be a floating-point tensor"),
        ("float16 k vs float32 q", (q, k.half(), v), {}, TypeError, "k has dtype torch.float16"),
        ("empty q", (q[:, :, :0], k, v), {}, ValueError, "q must not be empty"),
        ("heads not divisible", (q[:, :3], k, v), {}, ValueError, "must be divisible"),
        ("batch differs", (q, k[:1], v[:1]), {}, ValueError, "B = 2"),
        ("head dim differs", (q, k[..., :4], v), {}, ValueError, "d = 8"),
        ("v length differs", (q, k, v[:, :, :5]), {}, ValueError, "v (B, H_kv, m, d_v) must match"),
        ("mask float", (q, k, v), dict(key_padding_mask=mask.float()), TypeError, "boolean"),
        ("mask shape", (q, k, v), dict(key_padding_mask=mask[:, :5]), ValueError, "(2, 6)"),
        ("mask rank", (q, k, v), dict(key_padding_mask=mask[0]), ValueError, "2 dimensions"),
        ("scale negative", (q, k, v), dict(scale=-1.0), ValueError, "positive finite"),
        ("scale nan", (q, k, v), dict(scale=float("nan")), ValueError, "positive finite"),
        ("scale string", (q, k, v), dict(scale="0.1"), TypeError, "scale must be a float"),
        ("block_q zero", (q, k, v), dict(block_q=0), ValueError, "block_q must be a positive"),
        ("block_k float", (q, k, v), dict(block_k=2.0), TypeError, "block_k must be an int"),
        ("is_causal int", (q, k, v), dict(is_causal=1), TypeError, "is_causal must be a bool"),
        ("return_lse str", (q, k, v), dict(return_lse="yes"), TypeError, "return_lse must be"),
        ("softcap zero", (q, k, v), dict(softcap=0.0), ValueError, "softcap must be a positive"),
        ("offset negative", (q, k, v), dict(offset=-1), ValueError, "offset must be an int >= 0"),
        ("window zero", (q, k, v), dict(window=0), ValueError, "window must be a positive"),
        ("slopes per kv head", (q, k, v), dict(alibi_slopes=torch.ones(2)), ValueError,
         "alibi_slopes must hold one slope per query head (H = 4)"),
        ("slopes int", (q, k, v), dict(alibi_slopes=torch.ones(4, dtype=torch.long)), TypeError,
         "alibi_slopes must be a floating-point tensor"),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda case: case[0])
def test_rejects_bad_inputs_with_a_clear_error(case):
    _, args, kwargs, error, message = case
    with pytest.raises(error, match=re.escape(message)):
        flash_attention(*args, **kwargs)
