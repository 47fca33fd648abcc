"""plainformer.inference.linear_kernels: x Wᵀ + b as torch.nn.Linear computes it, on every kernel decoding may use."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plainformer.inference.linear_kernels import FEW_ROWS, KERNELS, MeasuredLinear, kernel_for, linear
from tests.reference.torch_reference import assert_close


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 24), (24,), (3, 2, 24)], ids=str)
def test_matches_torch_linear_in_float64(shape, bias):
    torch.manual_seed(0)
    theirs = nn.Linear(24, 10, bias=bias, dtype=torch.float64)
    ours = MeasuredLinear(24, 10, bias=bias, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(*shape, dtype=torch.float64)
    assert_close(ours(x), theirs(x))


def _runs_here(name: str, dtype: torch.dtype) -> bool:
    try:
        KERNELS[name](torch.ones(1, 8, dtype=dtype), torch.ones(4, 8, dtype=dtype), None)
    except RuntimeError:  # oneDNN's bf16 kernels need AVX-512; the suite also runs on AVX2-only CPUs
        return False
    return True


def _float64_product(x, weight, bias):
    return nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())


ONE_ROW_SHAPES = [(1, 1, 256), (1, 256), (256,)]
KERNEL_SHAPES = [(name, shape) for name in sorted(KERNELS)
                 for shape in ONE_ROW_SHAPES + ([] if name == "mv" else [(2, 3, 256)])]  # mv: one row only


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("name", "shape"), KERNEL_SHAPES, ids=str)
def test_every_kernel_matches_the_float64_product_in_float32(name, shape, bias):
    """Summation order only: 1e-5 relative to the largest output (entries of ~16 here)."""
    torch.manual_seed(0)
    x, weight, b = torch.randn(*shape), torch.randn(64, 256), torch.randn(64) if bias else None
    out = KERNELS[name](x, weight, b)
    expected = _float64_product(x, weight, b)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_kernel_matches_the_float64_product_up_to_bf16_rounding(name, bias):
    """fp32 accumulation, one bf16 rounding of the result (and of the bias sum): within 2 units of
    2^-8 relative to the largest output."""
    if not _runs_here(name, torch.bfloat16):
        pytest.skip(f"{name} has no bf16 kernel on this CPU")
    torch.manual_seed(0)
    x, weight = torch.randn(1, 1, 256).bfloat16(), torch.randn(64, 256).bfloat16()
    b = torch.randn(64).bfloat16() if bias else None
    out = KERNELS[name](x, weight, b)
    expected = _float64_product(x, weight, b)
    assert out.shape == (1, 1, 64) and out.dtype == torch.bfloat16
    assert (out.double() - expected).abs().max() <= 2 * 2**-8 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 5])
def test_a_decoding_product_runs_on_the_kernel_measured_for_it(dtype, rows):
    torch.manual_seed(0)
    x, weight, b = torch.randn(rows, 256).to(dtype), torch.randn(64, 256).to(dtype), torch.randn(64).to(dtype)
    name = kernel_for(dtype, rows)
    assert name in KERNELS and _runs_here(name, dtype)
    assert name != "mv" or rows == 1
    with torch.inference_mode():
        assert torch.equal(linear(x, weight, b), KERNELS[name](x, weight, b))


def test_many_rows_and_recorded_products_take_torch_linear():
    """Past FEW_ROWS rows, and wherever autograd records (only F.linear has a backward)."""
    torch.manual_seed(0)
    weight = torch.randn(8, 32)
    many = torch.randn(FEW_ROWS + 1, 32)
    assert torch.equal(linear(many, weight), nn.functional.linear(many, weight))
    x = torch.randn(1, 32, requires_grad=True)
    out = linear(x, weight)
    assert out.grad_fn is not None


def test_state_dict_and_type_are_those_of_torch_linear():
    layer = MeasuredLinear(4, 3)
    assert isinstance(layer, nn.Linear)
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_gradients_flow_through_a_one_row_product():
    torch.manual_seed(0)
    layer = MeasuredLinear(8, 4).to(torch.bfloat16)
    x = torch.randn(1, 8, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    expected = layer.weight.double().sum(dim=0)  # d(sum of outputs)/dx = the column sums of W
    assert (x.grad.double() - expected).abs().max() <= 2 * 2**-8 * expected.abs().max()


def test_measure_kernels_swaps_every_linear_sharing_its_weights():
    import plainformer as pf
    from plainformer.inference.linear_kernels import measure_kernels

    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(vocab_size=20, block_size=8, n_layers=1, n_heads=2, d_model=16, d_ff=32)).eval()
    idx = torch.randint(0, 20, (1, 6))
    state = model.state_dict()
    with torch.no_grad():
        before = model(idx)[0]
        measure_kernels(model)
        after = model(idx)[0]
    assert all(type(m) is MeasuredLinear for m in model.modules() if isinstance(m, nn.Linear))
    assert model.lm_head.weight is model.token_embedding.weight  # still tied
    assert model.state_dict().keys() == state.keys()
    assert_close(after, before)
