"""Each product of a linear layer's training step on the faster of torch's two float32 CPU kernels.

A linear layer y = x Wᵀ + b (x: (rows, d_in), W: (d_out, d_in), G = ∂L/∂y: (rows, d_out)) costs three
matrix products a training step:

    forward       y     = x Wᵀ + b
    grad_input    ∂L/∂x = G W
    grad_weight   ∂L/∂W = Gᵀ x        (and ∂L/∂b = Σ_rows G, no product)

torch's CPU build computes each on aten's kernel (MKL's gemm: what `F.linear` and autograd run) or on
oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`). Which is faster depends on the CPU and the
product: on a 2-core AMD EPYC with AVX-512 (Zen 4), oneDNN took 0.78-0.91x aten's time for the 6 x 384
GPT's forward and input-gradient products, and 1.06-1.6x for the weight gradients (whose operands are
transposed views) of every training shape measured; with AVX2 only, aten won nearly everything; with a few
hundred rows or fewer, aten won everything by 1.1-8x (`benchmarks/matmul_kernels.py`, docs/experiments.md).

So a float32 run times both kernels on the model's own layer shapes (`choose_kernels`, before the first
step) and trains each product on oneDNN only where it measured at least MIN_SPEEDUP times aten's speed:
near-ties stay on aten, so two runs of a recipe on one machine multiply alike. Products on oneDNN run
through an autograd Function of ours, which costs 3-4% of a layer's step at a few hundred to 2,048 rows of
width 128 (a Python call each way), so the products chosen must also make the layers' whole step (forward
and backward, through that Function) MIN_STEP_SPEEDUP times as fast as F.linear's, or every product stays on
aten: at nanogpt-cpu's shapes oneDNN's forward and input gradient, 1.06-1.13x faster alone, made the step
0.92-0.94x as fast; at 6 x 384's, 1.26-1.41x faster alone, 1.08-1.20x. The choice goes into the
checkpoint, and a resumed run takes it from there, so resuming stays bit-exact. The products differ from
aten's in summation order only (fp32: ~1e-6 relative).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..inference.layers import linear_layers
from ..inference.timing import fastest

PRODUCTS = ("forward", "grad_input", "grad_weight")
#: product -> kernel of a run that multiplies as autograd does (and as checkpoints without a choice did).
ATEN: dict[str, str] = dict.fromkeys(PRODUCTS, "aten")
#: oneDNN takes a product where it measures at least this many times aten's speed ...
MIN_SPEEDUP = 1.1
#: ... and the products it takes make the layers' whole step at least this many times as fast.
MIN_STEP_SPEEDUP = 1.03
#: The products are timed on at most this many rows (GPT-2 small at 12 x 1024 tokens would take ~1 min).
MAX_TIMED_ROWS = 2048

Kernel = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]


def _onednn(a: Tensor, b_t: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


#: name -> kernel(a (rows, k), b_t (cols, k), bias (cols,) | None) -> a b_tᵀ + bias (rows, cols); the
#: operands may be transposed views, as two of the three products need.
KERNELS: dict[str, Kernel] = {"aten": F.linear, "onednn": _onednn}


class _LinearProducts(torch.autograd.Function):
    """y = x Wᵀ + b and its gradients, each product on the kernel `kernels` names for it."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None,
                kernels: Mapping[str, str]) -> Tensor:
        """x (rows, d_in), weight (d_out, d_in), bias (d_out,) | None -> y (rows, d_out)."""
        ctx.save_for_backward(x, weight)
        ctx.kernels = kernels
        return KERNELS[kernels["forward"]](x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        kernels, grad = ctx.kernels, grad.contiguous()  # (rows, d_out); oneDNN takes dense or transposed
        wants_x, wants_weight, wants_bias, _ = ctx.needs_input_grad
        grad_x = KERNELS[kernels["grad_input"]](grad, weight.t(), None) if wants_x else None  # G W
        grad_weight = KERNELS[kernels["grad_weight"]](grad.t(), x.t(), None) if wants_weight else None  # Gᵀ x
        grad_bias = grad.sum(0) if wants_bias else None
        return grad_x, grad_weight, grad_bias, None


def chosen_linear(x: Tensor, weight: Tensor, bias: Tensor | None, kernels: Mapping[str, str]) -> Tensor:
    """x (..., d_in), W (d_out, d_in), b (d_out,) | None -> x Wᵀ + b (..., d_out), each float32 CPU product
    on the kernel `kernels` names for it; any other product (another dtype or device, under autocast) is
    `F.linear`'s."""
    if not (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu")):
        return F.linear(x, weight, bias)
    y = _LinearProducts.apply(x.reshape(-1, weight.shape[1]), weight, bias, kernels)  # (rows, d_out)
    return y.view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def chosen_kernels(model: nn.Module, kernels: Mapping[str, str]) -> Iterator[nn.Module]:
    """`model` with each plain `nn.Linear` computing `chosen_linear` on `kernels` (product -> "aten" |
    "onednn") inside the block, and `F.linear` again after. The layers stay the same objects, with their
    parameters and hooks: only their forward is set for the block (a subclass with a forward of its own,
    a LoRA layer, keeps it). All-aten changes nothing."""
    if set(kernels) != set(PRODUCTS) or not set(kernels.values()) <= set(KERNELS):
        raise ValueError(f"kernels must map each of {', '.join(PRODUCTS)} to one of {', '.join(KERNELS)}, "
                         f"got {dict(kernels)}")
    layers = [] if dict(kernels) == ATEN else [
        layer for _, layer in linear_layers(model)  # a layer registered at several places once
        if type(layer).forward is nn.Linear.forward and "forward" not in vars(layer)]
    for layer in layers:
        vars(layer)["forward"] = functools.partial(_layer_forward, layer, dict(kernels))
    try:
        yield model
    finally:
        for layer in layers:
            del vars(layer)["forward"]


def _layer_forward(layer: nn.Linear, kernels: Mapping[str, str], x: Tensor) -> Tensor:
    return chosen_linear(x, layer.weight, layer.bias, kernels)


def choose_kernels(model: nn.Module, rows: int) -> tuple[dict[str, str], dict[str, float]]:
    """Time both kernels on each product of `model`'s linear layers at `rows` rows (at most
    MAX_TIMED_ROWS), each layer shape once, weighted by how many layers have it; where oneDNN wins a
    product, time the layers' whole step on that choice against F.linear's too ->
    (product -> the kernel to train it on, product -> aten's time / oneDNN's, and "step" -> F.linear's
    step time / the choice's, when a step was timed)."""
    shapes = Counter((layer.in_features, layer.out_features) for _, layer in linear_layers(model))
    rows = min(rows, MAX_TIMED_ROWS)
    seconds = {product: dict.fromkeys(KERNELS, 0.0) for product in PRODUCTS}
    for (d_in, d_out), count in shapes.items():
        for product, (a, b_t) in _operands(rows, d_in, d_out).items():
            for name, time in _kernel_seconds(a, b_t).items():
                seconds[product][name] += count * time
    speedups = {product: times["aten"] / times["onednn"] for product, times in seconds.items()}
    chosen = {product: "onednn" if speedup >= MIN_SPEEDUP else "aten" for product, speedup in speedups.items()}
    if chosen == ATEN:
        return chosen, speedups
    steps = [(count, *_step_seconds(rows, d_in, d_out, chosen)) for (d_in, d_out), count in shapes.items()]
    speedups["step"] = sum(count * aten for count, aten, _ in steps) / sum(count * ours for count, _, ours in steps)
    return (chosen if speedups["step"] >= MIN_STEP_SPEEDUP else dict(ATEN)), speedups


def _layer_tensors(rows: int, d_in: int, d_out: int) -> tuple[Tensor, Tensor, Tensor]:
    """x (rows, d_in), W (d_out, d_in) and G (rows, d_out) of one layer to time, with constant entries: the
    time does not depend on the values, and the run's RNG streams stay untouched."""
    x, weight, grad = (torch.full(shape, 0.5) for shape in [(rows, d_in), (d_out, d_in), (rows, d_out)])
    return x, weight, grad


def _operands(rows: int, d_in: int, d_out: int) -> dict[str, tuple[Tensor, Tensor]]:
    """product -> (a, b_t) with product = a b_tᵀ, as `_LinearProducts` passes them."""
    x, weight, grad = _layer_tensors(rows, d_in, d_out)
    return {"forward": (x, weight), "grad_input": (grad, weight.t()), "grad_weight": (grad.t(), x.t())}


def _kernel_seconds(a: Tensor, b_t: Tensor) -> dict[str, float]:
    """kernel name -> its best seconds for a b_tᵀ (`inference.timing.fastest`)."""
    def product(kernel: Kernel) -> Callable[[], Tensor]:
        return lambda: kernel(a, b_t, None)

    return fastest({name: product(kernel) for name, kernel in KERNELS.items()})[1]


def _step_seconds(rows: int, d_in: int, d_out: int, kernels: Mapping[str, str]) -> tuple[float, float]:
    """(F.linear's, `_LinearProducts` on `kernels`') best seconds for one layer's forward and backward,
    the gradients of x and W, at `rows` rows."""
    x, weight, grad = _layer_tensors(rows, d_in, d_out)
    x.requires_grad_()
    weight.requires_grad_()
    seconds = fastest({
        "aten": lambda: torch.autograd.grad(F.linear(x, weight), (x, weight), grad),
        "chosen": lambda: torch.autograd.grad(_LinearProducts.apply(x, weight, None, kernels), (x, weight), grad),
    }, autograd=True)[1]
    return seconds["aten"], seconds["chosen"]


def describe(kernels: Mapping[str, str], speedups: Mapping[str, float] | None = None) -> str:
    """One line for the log: each product's kernel, with oneDNN's measured speedup when there is one,
    and the layers' whole step's when one was timed."""
    products = ", ".join(f"{product.replace('_', ' ')} {kernels[product]}"
                         + ("" if speedups is None else f" ({speedups[product]:.2f}x)") for product in PRODUCTS)
    step = (speedups or {}).get("step")
    return products if step is None else f"{products}; their layers' step {step:.2f}x"
