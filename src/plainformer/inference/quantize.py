"""Weight-only int8 for decoding: each linear layer's weight as int8 with one fp32 scale per output row.

    s_o = max_i |W_oi| / 127,   Q_oi = round(W_oi / s_o) ∈ [-127, 127],   y = x (Q · s)ᵀ + b

Decoding one token reads every weight once, so a weight of 1 byte instead of 4 is up to 4x less to
read. Whether that pays depends on the kernel the CPU has; `quantize` measures them once (`KERNELS`):

    fbgemm     torch's dynamic quantized linear (x quantized per tensor to 7 bits on the fly, an int8
               x int8 product, fp32 out): faster than fp32 decoding's product (`inference.linear_kernels`)
               on the AMD EPYCs measured, with AVX-512, AVX2 emulated and AVX2 only
    dequant    x (Q · s)ᵀ in fp32, the weight dequantized at every call: exact to Q, never faster than
               fp32, but it runs everywhere (GPUs, CPUs without fbgemm)

(torch._weight_int8pack_mm was slower than fp32 on the AVX2-only EPYC, so it is not offered. The timings:
docs/performance.md, "Choices inside the code".)
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.lora import refuse_lora_layers
from ..nn.moe import MoEFeedForward
from .layers import replace_linears
from .linear_kernels import linear
from .timing import fastest

#: The kernels an `Int8Linear` runs on, fastest first where they exist.
KERNELS = ("fbgemm", "dequant")


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """W (out, in) -> (Q int8 (out, in), s fp32 (out,)), symmetric per output row; an all-zero row
    gets s = 1 (any scale reproduces it)."""
    scale = weight.detach().abs().amax(dim=1).float() / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (weight.detach().float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x (Q · s)ᵀ + b for x (..., in) -> (..., out), Q int8 (out, in) and s (out,) as buffers
    (`weight_int8`, `scale`), on the `kernel` named (see the module docstring)."""

    weight_int8: Tensor
    scale: Tensor

    def __init__(self, linear: nn.Linear, kernel: str):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.in_features, self.out_features, self.kernel = linear.in_features, linear.out_features, kernel
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self._packed = _fbgemm_pack(q, scale, self.bias) if kernel == "fbgemm" else None

    def dequantized(self) -> Tensor:
        """Q · s, (out, in) in fp32: the weight this layer computes with."""
        return self.weight_int8.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if self._packed is not None and x.device.type == "cpu":
            # reduce_range: 7-bit activations, so that AVX2's 16-bit pair sums cannot saturate
            return torch.ops.quantized.linear_dynamic(x.float(), self._packed, True).to(x.dtype)
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, kernel={self.kernel}"


def _fbgemm_pack(q: Tensor, scale: Tensor, bias: Tensor | None) -> object:
    with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm's linear needs one
        warnings.simplefilter("ignore")
        zero_points = torch.zeros_like(scale, dtype=torch.long)
        weight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(weight, bias)


def fastest_kernel(device: torch.device, log: Callable[[str], None] | None = None) -> str:
    """The int8 kernel for `device`: fbgemm where torch has it and it beats fp32 decoding's product
    (`inference.linear_kernels.linear`) over four GPT-2-sized layers, one row (`timing.fastest`, ~0.1 s), else dequant,
    said once on `log` (default: stderr)."""
    log = log or (lambda line: print(line, file=sys.stderr))
    if device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines:
        layers = [nn.Linear(768, 3072), nn.Linear(3072, 768)] * 2
        int8 = [Int8Linear(layer, "fbgemm") for layer in layers]
        inputs = {d_in: torch.randn(1, d_in) for d_in in (768, 3072)}
        choice, seconds = fastest({
            "fp32": lambda: [linear(inputs[layer.in_features], layer.weight, layer.bias) for layer in layers],
            "fbgemm": lambda: [layer(inputs[layer.in_features]) for layer in int8]})
        if choice == "fbgemm":
            return "fbgemm"
        log(f"int8: no int8 kernel beats fp32 on this CPU (fbgemm {seconds['fbgemm'] * 1e3:.2f} ms against fp32 "
            f"{seconds['fp32'] * 1e3:.2f} ms for four GPT-2 layers, one row); running the int8 weights "
            "dequantized, slower than fp32")
    else:
        log(f"int8: no fast int8 kernel on {device.type}; running the int8 weights dequantized, slower than fp32")
    return "dequant"


def quantize(model: nn.Module, mode: str = "int8", *, kernel: str | None = None,
             log: Callable[[str], None] | None = None) -> nn.Module:
    """Every `nn.Linear` of `model` (attention, feed-forward, the head) as an `Int8Linear`, in place;
    returns `model`, for inference. `kernel` defaults to the fastest one measured on the model's device.

    Refused with a ValueError: a mode other than "int8", a model that is not float32, stacked MoE
    expert weights (not linear layers), LoRA layers that are not merged away (`unload_lora` first)."""
    if mode != "int8":
        raise ValueError(f"mode must be 'int8' (weight-only, per output row), got {mode!r}")
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.dtype != torch.float32:
        raise ValueError(f"quantize takes a float32 model, got {None if parameter is None else parameter.dtype}")
    refuse_lora_layers(model)
    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            raise ValueError(f"{name} holds the stacked weights of its experts, which int8 does not quantize: "
                             "quantize a dense model")
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    kernel = kernel or fastest_kernel(parameter.device, log)
    return replace_linears(model, lambda layer: Int8Linear(layer, kernel).to(layer.weight.device))
