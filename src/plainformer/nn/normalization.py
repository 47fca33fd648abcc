"""Normalisation layers.

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) ⊙ γ + β        (Ba et al. 2016)
    RMSNorm(x)   = x / sqrt(mean(x²) + eps) ⊙ γ                      (Zhang & Sennrich 2019)

both over the last axis (d_model).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _checks

NORMS = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """x / RMS(x) ⊙ weight over the last axis; computed in at least float32 (half-precision inputs are
    upcast for the mean of squares, float64 inputs stay float64)."""

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        _checks.check_positive_int("d_model", d_model)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., d_model) -> same shape; not checked here, a hot path (the layers check x)."""
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def make_norm(kind: str, d_model: int, *, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """"layernorm" (torch's LayerNorm) or "rmsnorm" over d_model features."""
    _checks.check_choice("norm", kind, NORMS)
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps=eps)
    return nn.LayerNorm(d_model, eps=eps, bias=bias)
