"""RMSNorm against a float64 hand computation; the LayerNorm path of make_norm against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plainformer as pf
from plainformer.nn.normalization import make_norm
from tests.reference.torch_reference import assert_close


def _hand_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x_i / sqrt(mean_j x_j² + eps) · γ_i, in float64."""
    x, weight = x.double(), weight.double()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_matches_the_hand_computation(dtype):
    torch.manual_seed(0)
    norm = pf.RMSNorm(8, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = 3 * torch.randn(2, 5, 8, dtype=dtype)
    out = norm(x)
    assert out.dtype == dtype
    assert_close(out, _hand_rms_norm(x, norm.weight, 1e-6).to(dtype))


def test_rms_norm_is_computed_in_float32_for_bfloat16_inputs():
    torch.manual_seed(0)
    norm = pf.RMSNorm(8).to(torch.bfloat16)
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    expected = (_hand_rms_norm(x.float(), torch.ones(8), 1e-6).float().to(torch.bfloat16) * norm.weight)
    out = norm(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_rms_norm_gradients_match_autograd_through_the_hand_computation():
    """The written-out backward against autograd of the float64 formula, for x and the weight."""
    torch.manual_seed(0)
    norm = pf.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = (3 * torch.randn(2, 5, 16)).requires_grad_()
    grad = torch.randn(2, 5, 16)
    ours = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    expected = torch.autograd.grad(_hand_rms_norm(x, norm.weight, 1e-5), (x, norm.weight), grad.double())
    for got, want in zip(ours, expected, strict=True):
        assert_close(got, want.float())


def test_rms_norm_backward_is_differentiable_in_float64():
    norm = pf.RMSNorm(8, eps=1e-5).double()
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))
    assert torch.autograd.gradgradcheck(norm, (x,))


def test_rms_norm_gives_unit_root_mean_square_and_ignores_scale():
    norm = pf.RMSNorm(16, eps=0.0).double()
    x = torch.randn(4, 16, dtype=torch.float64)
    out = norm(x)
    assert_close(out.pow(2).mean(-1), torch.ones(4, dtype=torch.float64))
    assert_close(norm(5 * x), out)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_path_matches_torch_and_the_hand_computation(bias):
    torch.manual_seed(0)
    norm = make_norm("layernorm", 8, eps=1e-5, bias=bias).double()
    assert isinstance(norm, torch.nn.LayerNorm) and (norm.bias is not None) == bias
    with torch.no_grad():
        for parameter in norm.parameters():
            parameter.copy_(torch.randn(8))
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    expected = F.layer_norm(x, (8,), norm.weight, norm.bias, eps=1e-5)
    assert_close(norm(x), expected)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    by_hand = (x - mean) / torch.sqrt(var + 1e-5) * norm.weight + (norm.bias if bias else 0)
    assert_close(norm(x), by_hand)


def test_make_norm_builds_rms_norm_with_the_given_eps():
    norm = make_norm("rmsnorm", 8, eps=1e-3)
    assert isinstance(norm, pf.RMSNorm) and norm.eps == 1e-3
