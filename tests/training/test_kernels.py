"""Tests for plainformer.training.kernels: each linear product on the kernel chosen for it, against float64;
the choice of a run, measured, kept in its directory and taken again on a resume."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plainformer.checkpoint.format import Checkpoint, CheckpointError
from plainformer.launch import Launch
from plainformer.training import kernels
from plainformer.training.config import TrainConfig
from plainformer.training.kernels import (
    ATEN,
    KERNELS_FILE,
    MAX_TIMED_ROWS,
    MIN_SPEEDUP,
    MIN_STEP_SPEEDUP,
    PRODUCTS,
    choose_kernels,
    chosen_kernels,
    chosen_linear,
    describe,
    keep_kernels,
    kept_kernels,
    run_kernels,
)

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
EVERY_CHOICE = [dict(zip(PRODUCTS, names, strict=True))
                for names in itertools.product(kernels.KERNELS, repeat=len(PRODUCTS))]


def _linear(d_in: int = 12, d_out: int = 10, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(d_in, d_out, bias=bias)


@needs_onednn
@pytest.mark.parametrize("choice", EVERY_CHOICE, ids=lambda c: "-".join(c.values()))
@pytest.mark.parametrize("bias", [True, False])
def test_every_choice_matches_float64_autograd_in_output_and_gradients(choice, bias):
    layer = _linear(bias=bias)
    x = torch.randn(3, 7, 12, requires_grad=True)  # (B, T, d_in)
    grad = torch.randn(3, 7, 10)
    y = chosen_linear(x, layer.weight, layer.bias, choice)
    y.backward(grad)

    x64 = x.detach().double().requires_grad_()
    params64 = [p.detach().double().requires_grad_() for p in layer.parameters()]
    y64 = F.linear(x64, *params64)
    y64.backward(grad.double())
    # fp32 against a float64 reference: sums of 12 (forward), 10 (grad input) and 21 (grad weight) products
    torch.testing.assert_close(y, y64.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(x.grad, x64.grad.float(), rtol=0, atol=1e-5)
    for p, p64 in zip(layer.parameters(), params64, strict=True):
        torch.testing.assert_close(p.grad, p64.grad.float(), rtol=0, atol=1e-5)


@needs_onednn
def test_a_frozen_weight_gets_no_gradient_and_its_input_still_does():
    layer = _linear()
    layer.requires_grad_(False)
    x = torch.randn(5, 12, requires_grad=True)
    chosen_linear(x, layer.weight, layer.bias, dict.fromkeys(PRODUCTS, "onednn")).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(5, 12), rtol=0, atol=1e-5)


@pytest.mark.parametrize("context", ["bfloat16 weights", "autocast"])
def test_other_dtypes_and_autocast_run_f_linear_itself(context):
    layer = _linear()
    if context == "bfloat16 weights":
        layer.to(torch.bfloat16)
    x = torch.randn(4, 12, dtype=layer.weight.dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=context == "autocast"):
        assert torch.equal(chosen_linear(x, layer.weight, layer.bias, dict.fromkeys(PRODUCTS, "onednn")),
                           F.linear(x, layer.weight, layer.bias))


# ----------------------------------------------------------------------------- swapping the layers

class Shared(nn.Module):
    """Two places hold one layer, as a tied or reused layer does; the head is a subclass with a forward
    of its own (as a LoRA layer is)."""

    def __init__(self):
        super().__init__()
        self.first = _linear(12, 12)
        self.second = self.first
        self.head = Doubled(12, 3)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


class Doubled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


@needs_onednn
def test_inside_the_block_the_plain_layers_compute_on_the_chosen_kernels_and_after_it_as_before(monkeypatch):
    model, x = Shared(), torch.randn(5, 12)
    expected = model(x)
    hooked, products = [], []
    model.first.register_forward_hook(lambda module, args, out: hooked.append(module))
    monkeypatch.setattr(kernels, "KERNELS", {name: _counting(kernel, name, products)
                                             for name, kernel in kernels.KERNELS.items()})
    with chosen_kernels(model, dict.fromkeys(PRODUCTS, "onednn")) as same:
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-5)
    assert same is model and hooked == [model.first] * 2  # the same layers, their hooks still called
    assert products == ["onednn"] * 2  # first and second; the head's own forward is left alone
    products.clear()
    assert torch.equal(model(x), expected) and products == [] and "forward" not in vars(model.first)


def _counting(kernel, name, calls):
    def counted(*args):
        calls.append(name)
        return kernel(*args)
    return counted


def test_the_layers_are_restored_after_an_exception_too():
    model = Shared()
    with pytest.raises(KeyboardInterrupt), chosen_kernels(model, dict.fromkeys(PRODUCTS, "onednn")):
        assert "forward" in vars(model.first)
        raise KeyboardInterrupt
    assert "forward" not in vars(model.first)


@pytest.mark.parametrize("kernels", [{"forward": "onednn"}, {**ATEN, "forward": "mkl"}])
def test_a_choice_without_every_product_or_with_an_unknown_kernel_is_refused(kernels):
    with pytest.raises(ValueError, match="kernels must map each of forward, grad_input, grad_weight to one of "
                                         "aten, onednn"), chosen_kernels(Shared(), kernels):
        pass


def test_all_aten_sets_nothing():
    model = Shared()
    with chosen_kernels(model, ATEN):
        assert "forward" not in vars(model.first)


# ----------------------------------------------------------------------------- choosing

_PRODUCT_SHAPES = {product: (a.shape, b_t.shape) for product, (a, b_t) in kernels._operands(32, 12, 10).items()}


def _linear_model() -> nn.Module:
    return nn.Sequential(_linear(12, 10), nn.ReLU(), _linear(10, 12))  # shapes (12, 10) and (10, 12)


@pytest.mark.parametrize("speedup, expected", [(MIN_SPEEDUP, "onednn"), (MIN_SPEEDUP - 0.01, "aten"), (0.5, "aten")])
def test_onednn_takes_a_product_only_from_min_speedup_on(monkeypatch, speedup, expected):
    speedups = {"forward": speedup, "grad_input": 1.0, "grad_weight": 0.7}

    def seconds(a, b_t):  # aten 1 s, oneDNN 1 / speedup, for the product these operands make
        product = next(name for name, shapes in _PRODUCT_SHAPES.items() if shapes == (a.shape, b_t.shape))
        return {"aten": 1.0, "onednn": 1.0 / speedups[product]}

    monkeypatch.setattr(kernels, "_kernel_seconds", seconds)
    monkeypatch.setattr(kernels, "_step_seconds", lambda rows, d_in, d_out, chosen: (1.0, 0.5))  # the step: 2x
    chosen, measured = choose_kernels(nn.Sequential(_linear(12, 10)), rows=32)
    assert chosen == {"forward": expected, "grad_input": "aten", "grad_weight": "aten"}
    assert measured == pytest.approx({**speedups, **({"step": 2.0} if expected == "onednn" else {})})


@pytest.mark.parametrize("step_speedup, expected", [(MIN_STEP_SPEEDUP, "onednn"), (MIN_STEP_SPEEDUP - 0.01, "aten")])
def test_products_on_onednn_must_speed_their_layers_whole_step_up_too(monkeypatch, step_speedup, expected):
    """Three 8 x 8 layers and one 8 x 4, oneDNN twice as fast on every product alone; the whole step through
    our autograd Function, timed per shape and weighted by its layers: 3 · 1 + 1 · 2 = 5 s on F.linear, 5 /
    step_speedup on the choice."""
    steps = []
    monkeypatch.setattr(kernels, "_kernel_seconds", lambda a, b_t: {"aten": 1.0, "onednn": 0.5})

    def step_seconds(rows, d_in, d_out, chosen):
        steps.append((rows, d_in, d_out, dict(chosen)))
        aten = 2.0 if d_out == 4 else 1.0
        return aten, aten / step_speedup

    monkeypatch.setattr(kernels, "_step_seconds", step_seconds)
    chosen, speedups = choose_kernels(nn.Sequential(*[_linear(8, 8) for _ in range(3)], _linear(8, 4)), rows=16)
    assert chosen == dict.fromkeys(PRODUCTS, expected)
    assert speedups == pytest.approx({**dict.fromkeys(PRODUCTS, 2.0), "step": step_speedup})
    assert steps == [(16, 8, 8, dict.fromkeys(PRODUCTS, "onednn")), (16, 8, 4, dict.fromkeys(PRODUCTS, "onednn"))]


def test_each_layer_shape_is_timed_once_on_at_most_max_timed_rows(monkeypatch):
    timed = []
    monkeypatch.setattr(kernels, "_kernel_seconds", lambda a, b_t: timed.append((a.shape, b_t.shape))
                        or {"aten": 1.0, "onednn": 1.0})
    choose_kernels(nn.Sequential(*[_linear(8, 8) for _ in range(3)], _linear(8, 4)), rows=10 * MAX_TIMED_ROWS)
    assert len(timed) == 2 * len(PRODUCTS)  # two shapes, three products each
    assert all(MAX_TIMED_ROWS in (*a, *b_t) for a, b_t in timed)


def test_a_shape_weighs_as_many_times_as_layers_have_it(monkeypatch):
    """Three 8 x 8 layers where oneDNN is twice as fast, one 8 x 4 where it is four times slower:
    3 · 1 + 1 · 1 = 4 s on aten against 3 · 0.5 + 1 · 4 = 5.5 s on oneDNN, for every product."""
    monkeypatch.setattr(kernels, "_kernel_seconds", lambda a, b_t: {
        "aten": 1.0, "onednn": 4.0 if 4 in (*a.shape, *b_t.shape) else 0.5})
    chosen, speedups = choose_kernels(nn.Sequential(*[_linear(8, 8) for _ in range(3)], _linear(8, 4)), rows=16)
    assert chosen == ATEN and speedups == pytest.approx(dict.fromkeys(PRODUCTS, 4 / 5.5))


@needs_onednn
def test_the_real_measurement_names_a_kernel_for_every_product():
    chosen, speedups = choose_kernels(_linear_model(), rows=64)
    assert set(chosen) == set(PRODUCTS) and set(speedups) - {"step"} == set(PRODUCTS)
    assert set(chosen.values()) <= set(kernels.KERNELS) and all(s > 0 for s in speedups.values())


@needs_onednn
def test_the_real_step_timing_runs_both_ways_with_gradients():
    aten, chosen = kernels._step_seconds(64, 12, 10, {"forward": "onednn", "grad_input": "onednn",
                                                     "grad_weight": "aten"})
    assert 0 < aten < float("inf") and 0 < chosen < float("inf")


def test_describe_names_each_product_and_its_speedup():
    assert describe({"forward": "onednn", "grad_input": "aten", "grad_weight": "aten"},
                    {"forward": 1.234, "grad_input": 1.0, "grad_weight": 0.5}) == \
        "forward onednn (1.23x), grad input aten (1.00x), grad weight aten (0.50x)"
    assert describe(ATEN) == "forward aten, grad input aten, grad weight aten"
    assert describe(ATEN, {"forward": 1.2, "grad_input": 1.15, "grad_weight": 0.5, "step": 0.94}) == \
        "forward aten (1.20x), grad input aten (1.15x), grad weight aten (0.50x); their layers' step 0.94x"


# ----------------------------------------------------------------------------- a run's choice

ONEDNN_FORWARD = {"forward": "onednn", "grad_input": "onednn", "grad_weight": "aten"}


class Rows:
    """A batch source whose every batch holds `batch_size` rows of 8 tokens, counting what it is asked for."""

    def __init__(self):
        self.asked = []

    def get_batch(self, split, index, batch_size):
        self.asked.append((split, index, batch_size))
        return {"idx": torch.zeros(batch_size, 8, dtype=torch.long), "targets": torch.zeros(batch_size, 8)}


def _checkpoint(trainer_state, path: Path = Path("run/last")) -> Checkpoint:
    return Checkpoint(path=path, family="tiny", model_config={}, train_config={}, state_dict={},
                      trainer_state=trainer_state)


@pytest.fixture
def measured(monkeypatch):
    """The measurement of `choose_kernels`, answering ONEDNN_FORWARD -> the rows it was asked for."""
    rows = []
    monkeypatch.setattr(kernels, "choose_kernels", lambda model, n: rows.append(n) or (
        dict(ONEDNN_FORWARD), dict(forward=1.2, grad_input=1.3, grad_weight=0.8)))
    return rows


@needs_onednn
def test_a_new_float32_run_measures_on_a_validation_batchs_tokens(measured, tmp_path):
    source = Rows()
    chosen, note = run_kernels(_linear_model(), TrainConfig(batch_size=3, dtype="float32"), source, tmp_path)
    assert chosen == ONEDNN_FORWARD and measured == [3 * 8] and source.asked == [("val", 0, 3)]
    assert note == ("linear kernels: forward onednn (1.20x), grad input onednn (1.30x), grad weight aten (0.80x) "
                    "(oneDNN's speed / aten's, measured)")


@needs_onednn
def test_a_resumed_run_takes_the_kernels_it_kept_without_measuring(measured, tmp_path):
    source = Rows()
    keep_kernels(tmp_path, ONEDNN_FORWARD)
    chosen, note = run_kernels(_linear_model(), TrainConfig(dtype="float32"), source, tmp_path, _checkpoint({}))
    assert chosen == ONEDNN_FORWARD and measured == [] and source.asked == []
    assert note == "linear kernels: forward onednn, grad input onednn, grad weight aten (resumed)"


@pytest.mark.parametrize("case", ["bfloat16", "compiled", "float64 model", "a process of a launch"])
def test_a_run_without_a_choice_trains_on_aten_and_measures_nothing(case, measured, monkeypatch, tmp_path):
    model, config = _linear_model(), TrainConfig(dtype="float32")
    if case == "bfloat16":
        config = config.replace(dtype="bfloat16")
    elif case == "compiled":
        config = config.replace(compile=True)
    elif case == "float64 model":
        model.double()
    else:
        monkeypatch.setattr(kernels, "current_launch", lambda: Launch(rank=1, world_size=2))
    keep_kernels(tmp_path, ONEDNN_FORWARD)
    for resume in (None, _checkpoint({})):
        assert run_kernels(model, config, Rows(), tmp_path, resume) == (ATEN, None)
    assert measured == []


def test_the_kept_kernels_are_the_run_files_then_an_older_checkpoints_then_aten(tmp_path):
    older = _checkpoint({"step": 4, "linear_kernels": dict(ONEDNN_FORWARD, grad_weight="onednn")})
    assert kept_kernels(tmp_path, _checkpoint({"step": 4})) == ATEN  # a run from before kernels were chosen
    assert kept_kernels(tmp_path, older) == dict(ONEDNN_FORWARD, grad_weight="onednn")  # as its Trainer kept them
    keep_kernels(tmp_path, ONEDNN_FORWARD)
    assert json.loads((tmp_path / KERNELS_FILE).read_text()) == ONEDNN_FORWARD
    assert [p.name for p in tmp_path.iterdir()] == [KERNELS_FILE]  # written in one rename, nothing left over
    assert kept_kernels(tmp_path, older) == ONEDNN_FORWARD


@pytest.mark.parametrize("where", ["run file", "older checkpoint"])
@pytest.mark.parametrize("choice", [
    {"forward": "onednn"}, {"forward": "mkl", "grad_input": "aten", "grad_weight": "aten"}, ["aten"] * 3])
def test_a_malformed_kept_choice_is_refused_naming_the_file_the_products_and_the_kernels(tmp_path, where, choice):
    if where == "run file":
        (tmp_path / KERNELS_FILE).write_text(json.dumps(choice))
        checkpoint, file = _checkpoint({"step": 4}), tmp_path / KERNELS_FILE
    else:
        checkpoint, file = _checkpoint({"step": 4, "linear_kernels": choice}), Path("run/last/trainer_state.json")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(file))}: kernels must map each of forward, "
                                              r"grad_input, grad_weight to one of aten, onednn, got "):
        kept_kernels(tmp_path, checkpoint)
