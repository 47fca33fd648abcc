"""The affine map y = x Wᵀ + b, on the fastest of torch's CPU kernels for the few-row products of decoding.

Decoding multiplies one row per sequence by every weight matrix, so a step is bound by how fast the
weights stream from memory, and which of torch's kernels streams them fastest depends on the CPU and
the dtype: on one AVX-512 AMD EPYC oneDNN on the weight as it is won in fp32 by far and in bf16 narrowly,
and with AVX2 alone it refuses bf16, where F.linear and torch.mv tie (measured: docs/performance.md,
"Choices inside the code").

So `linear` times the `KERNELS` once per process, for each dtype and for one row or several
(`kernel_for`, in a fraction of a second, on the first product that needs it), and runs the fastest from
then on. That choice applies to the products decoding makes: on the CPU, in float32 or bfloat16, of at
most FEW_ROWS rows, with autograd not recording (only F.linear has a backward). Everything else is F.linear.
The kernels differ in summation order only (fp32: ~1e-6 relative to F.linear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.lora import refuse_lora_layers
from .layers import replace_linears
from .timing import fastest

#: The products with this many rows or fewer (x.numel() / d_in) run on the measured kernel.
FEW_ROWS = 16
_TIMED_ROWS = {True: 1, False: 8}  # one row / several rows
_MEASURED_DTYPES = (torch.float32, torch.bfloat16)

LinearKernel = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]


def _matrix_vector(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """W x for one row x (..., d_in) with x.numel() == d_in."""
    y = torch.mv(weight, x.reshape(-1))  # (d_out,)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's inner product on the plain (d_out, d_in) weight (inductor's op for frozen CPU graphs)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


#: name -> kernel(x (..., d_in), W (d_out, d_in), b (d_out,) | None) -> (..., d_out).
KERNELS: dict[str, LinearKernel] = {"aten": F.linear, "mv": _matrix_vector, "onednn": _onednn}
_ONE_ROW_ONLY = ("mv",)
_chosen: dict[tuple[torch.dtype, bool], str] = {}  # (dtype, one row) -> the name of the measured kernel


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., d_in), weight W (d_out, d_in), bias (d_out,) -> x Wᵀ + b (..., d_out)."""
    if _decoding_product(x, weight, bias):
        return KERNELS[kernel_for(x.dtype, x.numel() // x.shape[-1])](x, weight, bias)
    return F.linear(x, weight, bias)


def _decoding_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return (x.device.type == "cpu" and x.dtype in _MEASURED_DTYPES and x.dtype == weight.dtype
            and 0 < x.numel() <= FEW_ROWS * x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def kernel_for(dtype: torch.dtype, rows: int) -> str:
    """The name of the fastest `KERNELS` entry on this CPU for `rows` rows of `dtype` (one row, or
    several up to FEW_ROWS), timed on the first call for each (dtype, one row or not) and kept."""
    key = (dtype, rows == 1)
    if key not in _chosen:
        _chosen[key] = _fastest(dtype, _TIMED_ROWS[rows == 1])
    return _chosen[key]


def _fastest(dtype: torch.dtype, rows: int) -> str:
    """Time each kernel on GPT-2-sized matrices (d_in 768 and 3072; 38 MB in fp32, beyond L2, so
    that the weights stream as in decoding)."""
    weights = [torch.full(shape, 0.01, dtype=dtype) for shape in [(3072, 768), (768, 3072)] * 2]
    inputs = {d_in: torch.full((rows, d_in), 0.5, dtype=dtype) for d_in in (768, 3072)}

    def product(kernel: LinearKernel) -> Callable[[], object]:
        return lambda: [kernel(inputs[w.shape[1]], w, None) for w in weights]

    candidates = {name: product(kernel) for name, kernel in KERNELS.items()
                  if rows == 1 or name not in _ONE_ROW_ONLY}
    return fastest(candidates)[0]


class MeasuredLinear(nn.Linear):
    """`torch.nn.Linear` (the same parameters, shared with the layer it replaces) computed by `linear`."""

    @classmethod
    def replacing(cls, layer: nn.Linear) -> MeasuredLinear:
        measured = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        measured.weight, measured.bias = layer.weight, layer.bias
        return measured

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def measure_kernels(model: nn.Module) -> nn.Module:
    """Every `nn.Linear` of `model` computed on the kernel measured fastest for decoding (in place;
    the weights are shared, so the state dict and any tied weights stay as they are) -> model."""
    refuse_lora_layers(model)
    return replace_linears(model, MeasuredLinear.replacing)
