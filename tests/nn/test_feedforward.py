"""FeedForward against the hand-written formulas: ReLU (paper), GELU and its tanh approximation, ReLU²,
SiLU, SwiGLU; ReLU² and SiLU against transformers' ACT2FN["relu2"] and ACT2FN["swish"]; position-wise; dropout."""

from __future__ import annotations

import math

import pytest
import torch

import plainformer as pf
from tests.reference.torch_reference import assert_close


def _hand_ffn(ffn: pf.FeedForward, x: torch.Tensor) -> torch.Tensor:
    """FFN(x) = act(x W_1ᵀ + b_1) W_2ᵀ + b_2 with the activation written out from its definition."""
    hidden = x @ ffn.W_1.weight.T + ffn.W_1.bias
    if ffn.activation == "relu":
        hidden = hidden.clamp_min(0)
    elif ffn.activation == "gelu":
        hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
    elif ffn.activation == "gelu_tanh":
        hidden = 0.5 * hidden * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden ** 3)))
    elif ffn.activation == "relu2":
        hidden = torch.where(hidden > 0, hidden * hidden, torch.zeros_like(hidden))
    elif ffn.activation == "silu":
        hidden = hidden / (1 + torch.exp(-hidden))
    else:
        hidden = hidden / (1 + torch.exp(-hidden)) * (x @ ffn.W_3.weight.T + ffn.W_3.bias)
    return hidden @ ffn.W_2.weight.T + ffn.W_2.bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "relu2", "silu", "swiglu"])
def test_matches_the_formula_computed_by_hand(activation, dtype):
    torch.manual_seed(0)
    ffn = pf.FeedForward(8, 32, activation).to(dtype)
    x = torch.randn(2, 5, 8, dtype=dtype)
    assert_close(ffn(x), _hand_ffn(ffn, x))


def test_relu2_is_transformers_relu_squared_activation():
    """The hidden layer of activation="relu2" is ACT2FN["relu2"] (Primer's squared ReLU) of x W_1ᵀ + b_1."""
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    ffn = pf.FeedForward(8, 32, "relu2")
    x = torch.randn(2, 5, 8)
    expected = ACT2FN["relu2"](ffn.W_1(x)) @ ffn.W_2.weight.T + ffn.W_2.bias
    assert_close(ffn(x), expected)


def test_silu_is_transformers_swish_activation():
    """The hidden layer of activation="silu" is ACT2FN["swish"] (opus-mt's activation_function) of x W_1ᵀ + b_1."""
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    ffn = pf.FeedForward(8, 32, "silu")
    x = torch.randn(2, 5, 8)
    expected = ACT2FN["swish"](ffn.W_1(x)) @ ffn.W_2.weight.T + ffn.W_2.bias
    assert_close(ffn(x), expected)


def test_projections_have_the_paper_shapes():
    ffn = pf.FeedForward(8, 32)
    assert ffn.W_1.weight.shape == (32, 8) and ffn.W_2.weight.shape == (8, 32) and ffn.W_3 is None
    assert not any("bias" in name for name, _ in pf.FeedForward(8, 32, bias=False).named_parameters())


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "relu2", "silu", "swiglu"])
def test_each_position_is_transformed_separately(activation):
    """FFN applied to a permuted sequence is the permuted FFN output: no mixing across positions."""
    torch.manual_seed(0)
    ffn = pf.FeedForward(8, 16, activation).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    permutation = torch.randperm(6)
    assert_close(ffn(x[:, permutation]), ffn(x)[:, permutation])
    assert_close(ffn(x[:, :1]), ffn(x)[:, :1])


def test_dropout_acts_on_the_hidden_layer_in_training_only():
    torch.manual_seed(0)
    ffn = pf.FeedForward(8, 64, dropout=0.5).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    ffn.eval()
    assert_close(ffn(x), _hand_ffn(ffn, x))
    ffn.train()
    torch.manual_seed(1)
    dropped = ffn(x)
    torch.manual_seed(1)
    keep = torch.nn.functional.dropout(torch.ones(2, 3, 64, dtype=torch.float64), 0.5)
    hidden = torch.relu(x @ ffn.W_1.weight.T + ffn.W_1.bias) * keep
    assert_close(dropped, hidden @ ffn.W_2.weight.T + ffn.W_2.bias)
