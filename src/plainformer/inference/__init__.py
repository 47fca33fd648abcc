"""Decoding-time transforms: a built model's linear layers swapped, in place, for layers that compute the
same product faster on this machine, by the commands that decode (`sample`, `serve`, `translate`,
`eval --quantize`). Models stay plain PyTorch; nothing here is a model's own.

- `kernels.measure_kernels`: each product of decoding's few rows on the kernel measured fastest here.
- `prepack.prepack`: weights reordered once into oneDNN's blocked layout (CPU).
- `quantize.quantize`: weight-only int8 with one scale per output row.

`for_decoding` picks what a command applies; all of them swap layers through `layers.replace_linears`.
"""

from __future__ import annotations

from torch import nn

from .linear_kernels import measure_kernels
from .prepack import prepack, prepack_supported
from .quantize import Int8Linear


def for_decoding(model: nn.Module) -> nn.Module:
    """`model` made fastest for decoding here, in place: on the CPU its weights prepacked for oneDNN
    where this CPU's oneDNN takes their dtype, else its products on the measured kernels; an int8
    model (`quantize`) keeps the kernels it measured; off the CPU, as it is. -> model."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or any(isinstance(m, Int8Linear) for m in model.modules()):
        return model
    return prepack(model) if prepack_supported(weight.dtype) else measure_kernels(model)
