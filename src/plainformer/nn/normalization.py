"""Normalisation layers.

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) ⊙ γ + β        (Ba et al. 2016)
    RMSNorm(x)   = x / sqrt(mean(x²) + eps) ⊙ γ                      (Zhang & Sennrich 2019)

both over the last axis (d_model).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from .. import _checks
from .dtypes import at_least_float32

NORMS = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """x / RMS(x) ⊙ weight over the last axis; computed in at least float32 (half-precision inputs are
    upcast for the mean of squares, float64 inputs stay float64)."""

    def __init__(self, d_model: int, eps: float = 1e-6, *, validate_args: bool = True):
        super().__init__()
        if validate_args:
            _checks.check_positive_int("d_model", d_model)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., d_model) -> same shape; not checked here, a hot path (the layers check x)."""
        return cast(Tensor, _RMSNormFunction.apply(x, self.weight, self.eps))


def _inverse_rms(wide: Tensor, eps: float) -> Tensor:
    """r = (mean(x²) + eps)^(-1/2) over the last axis: (..., d) -> (..., 1), in one read of x."""
    return torch.rsqrt(torch.linalg.vector_norm(wide, dim=-1, keepdim=True).square() / wide.shape[-1] + eps)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with its gradient written out: on CPU, where these passes are memory-bound, autograd
    through the composite makes about twice as many passes over x, and takes about twice the time
    (measured: docs/performance.md, "Choices inside the code").

    With x̂ = x · r, y = x̂ ⊙ γ and g = ∂L/∂y (rows n, features j; d features):

        ∂L/∂x = r · (g ⊙ γ) - x · r³/d · Σ_j g_j γ_j x_j        ∂L/∂γ = Σ_n g ⊙ x · r

    Both sums are matrix-vector products of g ⊙ x. r is recomputed from x, so the backward is itself
    differentiable; the rounding of x̂ to a half-precision x's dtype passes gradients through, as
    autograd's casts do.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        wide = at_least_float32(x)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return (wide * _inverse_rms(wide, eps)).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        wide = at_least_float32(x)
        inv_rms = _inverse_rms(wide, ctx.eps)  # (..., 1)
        d = x.shape[-1]
        grad_x_wide = (grad.to(wide.dtype) * wide).reshape(-1, d)  # g ⊙ x, (N, d)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_x_wide.t() @ inv_rms.reshape(-1)).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            projection = (grad_x_wide @ weight.to(wide.dtype)).view_as(inv_rms)  # Σ_j g_j γ_j x_j
            grad_x = torch.addcmul((grad * weight).to(wide.dtype) * inv_rms, wide,
                                   projection * inv_rms.pow(3) / d, value=-1).to(x.dtype)
        return grad_x, grad_weight, None


def make_norm(kind: str, d_model: int, *, eps: float = 1e-5, bias: bool = True,
              validate_args: bool = True) -> nn.Module:
    """"layernorm" (torch's LayerNorm) or "rmsnorm" over d_model features (validate_args: see
    `MultiHeadAttention`)."""
    if validate_args:
        _checks.check_choice("norm", kind, NORMS)
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps=eps, validate_args=validate_args)
    return nn.LayerNorm(d_model, eps=eps, bias=bias)
