"""The learned shortcuts of nn/shortcuts.py against their equations in float64: the value residual
v ← λ v + (1 − λ) v_1 and the embedding shortcut x ← a x + b x0, their starting values, float64 gradcheck
of the learned scalars, and the dtype a scalar leaves. The blocks that hand the first layer's values on, and a
whole GPT with them, are in tests/models/test_gpt.py."""

from __future__ import annotations

import torch

from plainformer.nn.shortcuts import EmbeddingShortcut, ValueResidual
from tests.reference.torch_reference import assert_close


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_value_residual_is_the_lambda_weighted_mean_of_a_layers_values_and_the_first_layers():
    residual = ValueResidual().double()
    assert residual.lam.tolist() == [0.5]  # modded-nanogpt's start
    with torch.no_grad():
        residual.lam.fill_(0.3)
    v, v1 = _randn(2, 2, 5, 4, seed=0), _randn(2, 2, 5, 4, seed=1)
    assert_close(residual(v, v1), 0.3 * v + 0.7 * v1)


def test_embedding_shortcut_starts_as_the_identity_and_computes_a_x_plus_b_x0():
    shortcut = EmbeddingShortcut().double()
    x, x0 = _randn(2, 5, 8, seed=0), _randn(2, 5, 8, seed=1)
    assert torch.equal(shortcut(x, x0), x)  # a = 1, b = 0
    with torch.no_grad():
        shortcut.a.fill_(0.5)
        shortcut.b.fill_(-2.0)
    assert_close(shortcut(x, x0), 0.5 * x - 2.0 * x0)


def test_float64_gradcheck_of_lambda_a_b_and_their_inputs():
    v, v1 = (_randn(1, 2, 3, 4, seed=s).requires_grad_() for s in (0, 1))
    lam = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    residual = ValueResidual().double()
    assert torch.autograd.gradcheck(
        lambda lam, v, v1: torch.func.functional_call(residual, {"lam": lam}, (v, v1)), (lam, v, v1))
    x, x0 = (_randn(2, 3, 4, seed=s).requires_grad_() for s in (2, 3))
    a, b = (torch.tensor([value], dtype=torch.float64, requires_grad=True) for value in (0.8, 0.4))
    shortcut = EmbeddingShortcut().double()
    assert torch.autograd.gradcheck(
        lambda a, b, x, x0: torch.func.functional_call(shortcut, {"a": a, "b": b}, (x, x0)), (a, b, x, x0))


def test_float32_scalars_leave_bfloat16_values_bfloat16():
    v = torch.randn(1, 2, 3, 4).bfloat16()
    assert ValueResidual()(v, v).dtype == torch.bfloat16
    assert EmbeddingShortcut()(v, v).dtype == torch.bfloat16
