"""Tests for plainformer.nn.linear: x Wᵀ + b as torch.nn.Linear computes it, one bf16 row included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plainformer.nn.linear import Linear
from tests.reference.torch_reference import assert_close


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 24), (24,), (3, 2, 24)], ids=str)
def test_matches_torch_linear_in_float64(shape, bias):
    torch.manual_seed(0)
    theirs = nn.Linear(24, 10, bias=bias, dtype=torch.float64)
    ours = Linear(24, 10, bias=bias, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(*shape, dtype=torch.float64)
    assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("bias", [True, False])
def test_one_bf16_row_matches_the_float64_product_up_to_bf16_rounding(bias):
    """The matrix-vector path (one row): fp32 accumulation, one bf16 rounding of the result (and
    of the bias sum): within 2 units of 2^-8 relative to the largest output."""
    torch.manual_seed(0)
    layer = Linear(256, 64, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, 1, 256).to(torch.bfloat16)
    out = layer(x)
    assert out.shape == (1, 1, 64) and out.dtype == torch.bfloat16
    expected = nn.functional.linear(x.double(), layer.weight.double(),
                                    None if layer.bias is None else layer.bias.double())
    assert (out.double() - expected).abs().max() <= 2 * 2**-8 * expected.abs().max()


def test_state_dict_and_type_are_those_of_torch_linear():
    layer = Linear(4, 3)
    assert isinstance(layer, nn.Linear)
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_gradients_flow_through_the_one_row_path():
    torch.manual_seed(0)
    layer = Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(1, 8, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    expected = layer.weight.double().sum(dim=0)  # d(sum of outputs)/dx = the column sums of W
    assert (x.grad.double() - expected).abs().max() <= 2 * 2**-8 * expected.abs().max()
