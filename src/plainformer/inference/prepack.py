"""Linear layers with their weights reordered once for oneDNN's CPU inner product: y = x Wᵀ + b.

Decoding reads every weight once per token, so the rate at which a kernel streams W sets the pace.
oneDNN streams a weight reordered into its blocked layout faster than the plain (d_out, d_in) one
that a trainable parameter must keep, and both faster than F.linear, near the copy bandwidth. The reorder
takes a fraction of a second for GPT-2 124M, so it pays after a few dozen tokens (measured:
docs/performance.md, "Choices inside the code").

`prepack(model)` swaps every `nn.Linear` for a `PackedLinear` in place: the model is for inference
only afterwards (no trainable or savable weights in those layers; prepack a copy, or load again).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from ..nn.lora import refuse_lora_layers
from .layers import linear_layers, replace_linears

#: Rows the blocked layout is chosen for (oneDNN's hint): the few rows of decoding. Any number of
#: rows computes the same product; even for one row this layout was faster than the one for 1 row
#: (GPT-2 124M, fp32: 12.7 against 15.2 ms).
ROWS_HINT = 8


@functools.cache
def prepack_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN reorders and multiplies `dtype` weights (bf16 needs AVX-512 or
    AVX-NE-CONVERT; fp32 runs on any x86-64 CPU torch supports)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        _product(torch.ones(1, 8, dtype=dtype), _reorder(torch.ones(4, 8, dtype=dtype)), None)
    except RuntimeError:
        return False
    return True


def _reorder(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def _product(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """y = x Wᵀ + b for x (..., in) -> (..., out), W held in oneDNN's blocked layout (an opaque
    tensor, no parameter) and b as a buffer. CPU inference only."""

    bias: Tensor | None

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _reorder(linear.weight)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return _product(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.packed.dtype}, prepacked"


def prepack(model: nn.Module) -> nn.Module:
    """Every `nn.Linear` of `model` (attention, feed-forward, the head) as a `PackedLinear`, in place;
    returns `model`, for inference on the CPU. A tied head keeps the embedding it shares its weight with.

    Refused with a ValueError: a model off the CPU, a dtype this CPU's oneDNN cannot pack
    (`prepack_supported`), LoRA layers not merged away (`unload_lora` first), no linear layer."""
    linears = linear_layers(model)
    if not linears:
        raise ValueError(f"{type(model).__name__} has no linear layer to prepack")
    refuse_lora_layers(model)
    for name, linear in linears:
        label = name or type(model).__name__
        if linear.weight.device.type != "cpu":
            raise ValueError(f"prepack lays weights out for oneDNN's CPU kernels; {label} is on {linear.weight.device}")
        if not prepack_supported(linear.weight.dtype):
            raise ValueError(f"this CPU's oneDNN cannot prepack {linear.weight.dtype} weights ({label}; bf16 needs "
                             "AVX-512 or AVX-NE-CONVERT): decode with the plain weights")
    return replace_linears(model, PackedLinear)
