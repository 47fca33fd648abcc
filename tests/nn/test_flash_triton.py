"""The Triton FlashAttention kernels, run by Triton's interpreter on CPU tensors, against SDPA.

TRITON_INTERPRET=1 must be set before triton is first imported (triton's own library functions are
decorated then), so this module sets it before importing triton. If triton was already imported
without it in this process, the module's tests are run again in a fresh process instead.
The interpreter runs programs one after another: shapes stay tiny and fp32 (its bf16 is broken).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from plainformer.nn import flash_triton as kernels  # noqa: E402

INTERPRETED = isinstance(triton.language.zeros, InterpretedFunction) and isinstance(
    kernels._forward_kernel, InterpretedFunction)
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="triton was imported before "
                                      "TRITON_INTERPRET=1; see test_kernels_in_a_fresh_process")


@pytest.mark.skipif(INTERPRETED, reason="this process already interprets the kernels")
def test_kernels_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    # -n 0: this one file in the child itself, not in workers of its own beside the suite's
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def make_inputs(n, m, *, heads=2, kv_heads=1, batch=2, dim=16, dim_v=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dim_v = dim if dim_v is None else dim_v
    q = torch.randn(batch, heads, n, dim, generator=gen)
    k = torch.randn(batch, kv_heads, m, dim, generator=gen)
    v = torch.randn(batch, kv_heads, m, dim_v, generator=gen)
    grad_out = torch.randn(batch, heads, n, dim_v, generator=gen)
    return [x.requires_grad_() for x in (q, k, v)] + [grad_out]


def reference(q, k, v, grad_out, *, is_causal, key_padding_mask):
    """Output and q/k/v gradients of torch's SDPA in float64 with an explicit boolean mask."""
    n, m = q.shape[2], k.shape[2]
    mask = torch.ones(n, m, dtype=torch.bool)
    mask = mask.tril() if is_causal else mask
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    return [out, *torch.autograd.grad(out, leaves, grad_out.double())]


def run(q, k, v, grad_out, **kwargs):
    out, lse = kernels.triton_flash_attention(q, k, v, **kwargs)
    return [out, *torch.autograd.grad(out, (q, k, v), grad_out)], lse


def assert_close(ours, theirs, tol=2e-5):
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == torch.float32
        assert (a.double() - b).abs().max().item() <= tol


@interpreted_only
@pytest.mark.parametrize("is_causal,padded", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("n,m", [(37, 45), (45, 20)])
def test_matches_sdpa_forward_and_backward(n, m, is_causal, padded):
    q, k, v, grad_out = make_inputs(n, m)
    mask = None
    if padded:
        mask = torch.rand(2, m, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[:, 0] = True
    ours, _ = run(q, k, v, grad_out, is_causal=is_causal, key_padding_mask=mask,
                  block_q=16, block_k=16)
    assert_close(ours, reference(q, k, v, grad_out, is_causal=is_causal, key_padding_mask=mask))


@interpreted_only
def test_multi_query_odd_head_dims_and_rectangular_tiles():
    q, k, v, grad_out = make_inputs(40, 33, heads=3, kv_heads=1, dim=12, dim_v=20)
    ours, _ = run(q, k, v, grad_out, is_causal=True, block_q=32, block_k=16)
    assert_close(ours, reference(q, k, v, grad_out, is_causal=True, key_padding_mask=None))


@interpreted_only
def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v, grad_out = make_inputs(20, 18)
    mask = torch.ones(2, 18, dtype=torch.bool)
    mask[0] = False
    mask[1, 0] = False  # causal query 0 of batch 1 sees only key 0
    ours, lse = run(q, k, v, grad_out, is_causal=True, key_padding_mask=mask,
                    block_q=16, block_k=16)
    out, dq, dk, dv = ours
    assert_close(ours, reference(q, k, v, grad_out, is_causal=True, key_padding_mask=mask))
    assert not out[0].any() and not dq[0].any()
    assert not out[1, :, 0].any() and not dq[1, :, 0].any()
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :, 0]).all()
    assert torch.isfinite(lse[1, :, 1:]).all()


@interpreted_only
def test_lse_matches_the_plain_pytorch_path():
    from plainformer.nn.flash import flash_attention

    q, k, v, grad_out = make_inputs(30, 25)
    _, lse = kernels.triton_flash_attention(q, k, v, is_causal=True, block_q=16, block_k=16)
    _, expected = flash_attention(q, k, v, is_causal=True, return_lse=True)
    # float32 only (the kernels take no float64): two float32 sums of 16 products and 25 exponentials in
    # different orders (numpy's in the interpreter, ATen's here) agree to a few ulps of |lse|: allow 16
    tolerance = 16 * torch.finfo(torch.float32).eps * expected.abs().max().item()
    assert torch.allclose(lse, expected, rtol=0, atol=tolerance)


@interpreted_only
@pytest.mark.parametrize("size", [8, 24, 48, 16.0])
def test_rejects_tiles_that_are_not_powers_of_two_from_16(size):
    q, k, v, _ = make_inputs(4, 4)
    with pytest.raises(ValueError, match="power of two >= 16"):
        kernels.triton_flash_attention(q, k, v, block_q=size)


@interpreted_only
def test_supports_half_precisions_and_fp32_up_to_head_dim_256():
    x = torch.zeros(1, 1, 1, 256)
    assert kernels.supports(x, x) and kernels.supports(x.bfloat16(), x.bfloat16())
    assert not kernels.supports(x.double(), x.double())
    assert not kernels.supports(torch.zeros(1, 1, 1, 257), x)
