"""Test support: copy weights between torch.nn reference modules and ours, and compare tensors.

torch packs W_q, W_k, W_v into one `in_proj_weight` (3·d_model, d_model); ours keeps three
`nn.Linear`s. These helpers map one layout onto the other so a test can run both on identical weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

import plainformer as pf

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def assert_close(actual: Tensor, expected: Tensor, what: str = "") -> None:
    """max |actual - expected| within the fixed tolerance of the dtype (fp32 1e-5, fp64 1e-10)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert error <= TOLERANCE[expected.dtype], f"{what}: max abs error {error:.3g}"


def upstream_like(output: Tensor) -> Tensor:
    """A fixed random G: tests differentiate <output, G>, which reaches every output entry."""
    return torch.randn(output.shape, generator=torch.Generator().manual_seed(5), dtype=output.dtype)


def input_and_parameter_grads(module: nn.Module, output: Tensor, inputs: tuple[Tensor, ...],
                              parameter_grads: Callable[[nn.Module], list[Tensor]]) -> list[Tensor]:
    """Gradients of <output, G> w.r.t. the distinct inputs, then `parameter_grads(module)`."""
    for parameter in module.parameters():
        parameter.grad = None
    upstream = upstream_like(output)
    distinct = list({id(x): x for x in inputs}.values())
    input_grads = torch.autograd.grad(output, distinct, upstream, retain_graph=True)
    output.backward(upstream)
    return [*input_grads, *parameter_grads(module)]


def randomize_biases(module: nn.Module, generator: torch.Generator) -> None:
    """torch initialises attention and norm biases to 0 (and γ to 1); random ones test more."""
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "bias" in name or name.endswith(("norm1.weight", "norm2.weight")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))


def load_torch_attention(ours: pf.MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    """Copy nn.MultiheadAttention's packed in_proj = [W_q; W_k; W_v] and out_proj into ours."""
    with torch.no_grad():
        for linear, weight in zip((ours.W_q, ours.W_k, ours.W_v), theirs.in_proj_weight.chunk(3), strict=True):
            linear.weight.copy_(weight)
        if theirs.in_proj_bias is not None:
            for linear, bias in zip((ours.W_q, ours.W_k, ours.W_v), theirs.in_proj_bias.chunk(3), strict=True):
                linear.bias.copy_(bias)
            ours.W_o.bias.copy_(theirs.out_proj.bias)
        ours.W_o.weight.copy_(theirs.out_proj.weight)


def attention_parameter_grads(module: pf.MultiHeadAttention | nn.MultiheadAttention) -> list[Tensor]:
    """Gradients of [W_q, W_k, W_v, W_o] weights then biases, in our layout, from either module."""
    if isinstance(module, nn.MultiheadAttention):
        weights = [*module.in_proj_weight.grad.chunk(3), module.out_proj.weight.grad]
        biases = [*module.in_proj_bias.grad.chunk(3), module.out_proj.bias.grad]
    else:
        linears = (module.W_q, module.W_k, module.W_v, module.W_o)
        weights = [linear.weight.grad for linear in linears]
        biases = [linear.bias.grad for linear in linears]
    return weights + biases


# (ours, torch's) names of the encoder layer's non-attention submodules
_LAYER_PAIRS = (("ff.W_1", "linear1"), ("ff.W_2", "linear2"), ("norm1", "norm1"), ("norm2", "norm2"))


def load_torch_encoder_layer(ours: pf.EncoderLayer, theirs: nn.TransformerEncoderLayer) -> None:
    """torch's linear1/linear2 are our ff.W_1/ff.W_2; norms and attention map by name."""
    load_torch_attention(ours.self_attn, theirs.self_attn)
    with torch.no_grad():
        for mine, their in _LAYER_PAIRS:
            ours.get_submodule(mine).load_state_dict(theirs.get_submodule(their).state_dict())


def encoder_layer_parameter_grads(module: pf.EncoderLayer | nn.TransformerEncoderLayer) -> list[Tensor]:
    """Gradients of every parameter of an encoder layer, in one order for ours and torch's."""
    side = 1 if isinstance(module, nn.TransformerEncoderLayer) else 0
    grads = attention_parameter_grads(module.self_attn)
    for names in _LAYER_PAIRS:
        submodule = module.get_submodule(names[side])
        grads += [submodule.weight.grad, submodule.bias.grad]
    return grads


def sinusoidal_by_hand(max_len: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)), entry by entry."""
    rows = []
    for pos in range(max_len):
        row = []
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            row += [math.sin(angle), math.cos(angle)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)
