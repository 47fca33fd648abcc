"""Each product of a linear layer's training step on the faster of torch's two float32 CPU kernels.

A linear layer y = x Wᵀ + b (x: (rows, d_in), W: (d_out, d_in), G = ∂L/∂y: (rows, d_out)) costs three
matrix products a training step:

    forward       y     = x Wᵀ + b
    grad_input    ∂L/∂x = G W
    grad_weight   ∂L/∂W = Gᵀ x        (and ∂L/∂b = Σ_rows G, no product)

torch's CPU build computes each on aten's kernel (MKL's gemm: what `F.linear` and autograd run) or on
oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`). Which is faster depends on the CPU, the
product and the number of rows (figures in docs/guide.md, "Training on the CPU").

A float32 run in one CPU process times both kernels on the model's own layer shapes (`choose_kernels`) and
trains each product on oneDNN only where it measured at least MIN_SPEEDUP times aten's speed, so that
near-ties stay on aten and two runs of a recipe on one machine multiply alike; and only where the products
chosen also make the layers' whole step (forward and backward, through the autograd Function of ours that
runs them, a Python call each way) MIN_STEP_SPEEDUP times as fast as F.linear's. The products differ from
aten's in summation order only (fp32: ~1e-6 relative).

The choice is the run's, not the Trainer's: the command that trains decides it before the Trainer is built
(`run_kernels`), applies it to the model for the run (`chosen_kernels`), and keeps it in the run
directory (KERNELS_FILE, `keep_kernels`), where a resumed run takes it again (`kept_kernels`), so that
resuming stays bit-exact.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint.format import TRAINER_STATE, Checkpoint, CheckpointError
from ..files.atomic import atomic_path
from ..files.json_file import read_json
from ..inference.layers import linear_layers
from ..inference.timing import fastest
from ..launch import current_launch
from .config import TrainConfig
from .precision import model_width, resolve_dtype

PRODUCTS = ("forward", "grad_input", "grad_weight")
#: product -> kernel of a run that multiplies as autograd does (and as runs without a choice did).
ATEN: dict[str, str] = dict.fromkeys(PRODUCTS, "aten")
#: oneDNN takes a product where it measures at least this many times aten's speed ...
MIN_SPEEDUP = 1.1
#: ... and the products it takes make the layers' whole step at least this many times as fast.
MIN_STEP_SPEEDUP = 1.03
#: The products are timed on at most this many rows (GPT-2 small at 12 x 1024 tokens would take ~1 min).
MAX_TIMED_ROWS = 2048
#: The file of a run directory that keeps the kernels its linear layers train on (JSON: product -> kernel).
KERNELS_FILE = "linear_kernels.json"

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
    check_kernels(kernels)
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


def check_kernels(kernels: Any) -> None:
    """A ValueError unless `kernels` maps each of PRODUCTS to the name of one of KERNELS."""
    if not (isinstance(kernels, Mapping) and set(kernels) == set(PRODUCTS)
            and all(isinstance(name, str) and name in KERNELS for name in kernels.values())):
        got = dict(kernels) if isinstance(kernels, Mapping) else kernels
        raise ValueError(f"kernels must map each of {', '.join(PRODUCTS)} to one of {', '.join(KERNELS)}, "
                         f"got {got}")


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


# ----------------------------------------------------------------------------- a run's choice


def has_kernel_choice(model: nn.Module, config: TrainConfig) -> bool:
    """Whether a run of `model` on `config` chooses its kernels: in float32 (`config.dtype` as it resolves
    here, `precision.resolve_dtype`), in one CPU process (each process of a launch would measure its own,
    and the replicas must multiply alike), eager (torch.compile generates its own kernels), with oneDNN in
    this build of torch."""
    weight = next(model.parameters())
    return (weight.device.type == "cpu" and current_launch().world_size == 1 and not config.compile
            and torch.backends.mkldnn.is_available() and all(p.dtype == torch.float32 for p in model.parameters())
            and resolve_dtype(config.dtype, weight.device, model_width(model))[0] == "float32")


def run_kernels(model: nn.Module, config: TrainConfig, source: Any, run_dir: Path, resume: Checkpoint | None = None
                ) -> tuple[dict[str, str], str | None]:
    """The kernels a run of `model` on `config` in `run_dir` trains on, before its first step -> (product ->
    kernel, the line to log, if any): aten's where it has no choice (`has_kernel_choice`); a run resumed from
    `resume` (its last/), those it kept (`kept_kernels`); a new run's measured here on as many rows as a batch
    of `source` (the Trainer's `get_batch`) has tokens, drawn from the validation split, so that what the
    steps draw stays theirs."""
    if not has_kernel_choice(model, config):
        return dict(ATEN), None
    if resume is not None:
        kept = kept_kernels(run_dir, resume)
        return kept, f"linear kernels: {describe(kept)} (resumed)"
    rows = next(iter(source.get_batch("val", 0, config.batch_size).values())).numel()
    kernels, speedups = choose_kernels(model, rows)
    return kernels, f"linear kernels: {describe(kernels, speedups)} (oneDNN's speed / aten's, measured)"


def keep_kernels(run_dir: Path, kernels: Mapping[str, str]) -> None:
    """Write the run's `kernels` to run_dir/KERNELS_FILE, where a resumed run finds them (`kept_kernels`)."""
    with atomic_path(run_dir / KERNELS_FILE) as tmp:
        tmp.write_text(json.dumps(dict(kernels)) + "\n", encoding="utf-8")


def kept_kernels(run_dir: Path, checkpoint: Checkpoint) -> dict[str, str]:
    """The kernels the run in `run_dir` trained on, for its resume from `checkpoint`: run_dir/KERNELS_FILE;
    for a run begun before that file, the "linear_kernels" of `checkpoint`'s trainer state, where the
    Trainer kept them then; aten's where neither holds any (a run begun before kernels were chosen). A
    CheckpointError naming the file when the choice there is malformed."""
    path = run_dir / KERNELS_FILE
    if path.is_file():
        kernels = read_json(path, error=CheckpointError)
    else:
        path = checkpoint.path / TRAINER_STATE
        kernels = (checkpoint.trainer_state or {}).get("linear_kernels")
        if kernels is None:
            return dict(ATEN)
    try:
        check_kernels(kernels)
    except ValueError as error:
        raise CheckpointError(f"{path}: {error}") from None
    return dict(kernels)
