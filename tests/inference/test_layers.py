"""The one way a decoding-time transform swaps a model's linear layers (inference/layers.py): every
`nn.Linear` found, subclasses included, and replaced in place by what `make` builds from it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import plainformer as pf
from plainformer.inference.layers import linear_layers, replace_linears
from plainformer.inference.linear_kernels import MeasuredLinear


class Transposed(nn.Module):
    """The product of a linear layer computed another way: x @ Wᵀ (stored transposed) + b."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.weight_t = nn.Parameter(layer.weight.detach().t().clone())
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        out = x @ self.weight_t
        return out if self.bias is None else out + self.bias


def _plain_linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def test_every_linear_is_listed_in_module_order_subclasses_included():
    measured = MeasuredLinear.replacing(nn.Linear(2, 2))
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), measured,
                          nn.Embedding(5, 2))
    assert [(name, type(layer)) for name, layer in linear_layers(model)] == [
        ("0", nn.Linear), ("2.0", nn.Linear), ("3", MeasuredLinear)]


def test_every_linear_of_a_gpt_is_replaced_and_the_logits_stay_those_of_the_original():
    """float64: x @ Wᵀ + b and nn.Linear's addmm differ only in summation order, ~1e-15 apart."""
    torch.manual_seed(0)
    config = pf.GPTConfig(vocab_size=37, block_size=16, n_layers=2, n_heads=2, d_model=16, d_ff=32, bias=True,
                          pos_encoding="rope", activation="swiglu")
    model = pf.GPT(config).double().eval()
    idx = torch.randint(37, (2, 12))
    with torch.no_grad():
        expected = model(idx)[0]
    before = linear_layers(model)
    made = []
    assert replace_linears(model, lambda layer: made.append(layer) or Transposed(layer)) is model
    assert made == [layer for _, layer in before] and len(made) == 2 * 7 + 1  # q, k, v, o, W_1, W_2, W_3; the head
    assert _plain_linears(model) == [] and linear_layers(model) == []
    assert [name for name, m in model.named_modules() if isinstance(m, Transposed)] == [name for name, _ in before]
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], expected, atol=1e-12, rtol=0)


def test_a_linear_registered_twice_is_replaced_at_both_places_by_one_layer():
    shared = nn.Linear(3, 3)
    inner = nn.Sequential(shared)
    model = nn.Sequential(shared, nn.ReLU(), inner, inner)  # and a parent registered twice too
    made = []
    replace_linears(model, lambda layer: made.append(layer) or Transposed(layer))
    assert made == [shared]
    assert isinstance(model[0], Transposed) and model[0] is inner[0] is model[2][0] is model[3][0]


def test_a_model_that_is_itself_a_linear_comes_back_replaced_and_unchanged_in_itself():
    layer = nn.Linear(3, 2)
    replaced = replace_linears(layer, Transposed)
    assert isinstance(replaced, Transposed)
    assert dict(layer.named_children()) == {} and set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(replaced.double()(x), layer.double()(x), atol=1e-12, rtol=0)
