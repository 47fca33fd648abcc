"""The affine map y = x Wᵀ + b, with a faster kernel for the one-row bf16 products of decoding.

Decoding one token of one sequence multiplies a single row by every weight matrix, so the step is
bound by how fast the weights stream from memory. On CPU, torch's matrix-vector product W x reads
bf16 weights at about 1.5x the rate of its matrix-matrix product for that one row (oneDNN's or
ATen's): GPT-2-width bf16 greedy decoding at batch 1 on one core, 4 layers, 60 tokens/s against 41
(48 when oneDNN was switched off process-wide around each step, the trick this replaces). With
more rows the matrix-matrix kernels win, and nothing changes for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., d_in), weight W (d_out, d_in), bias (d_out,) -> x Wᵀ + b (..., d_out)."""
    if _one_bf16_row_on_cpu(x, weight):
        y = torch.mv(weight, x.reshape(-1))  # (d_out,)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _one_bf16_row_on_cpu(x: Tensor, weight: Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.numel() == x.shape[-1])


class Linear(nn.Linear):
    """`torch.nn.Linear` (same parameters, same state dict) computed by `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
