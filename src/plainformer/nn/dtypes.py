"""The dtype reductions run in: a loss, a norm or a softmax of bf16 or fp16 values loses digits that fp32
keeps, so they are taken in float32; a float64 tensor keeps float64 (a reference run stays float64 from
the logits to the logged loss, so that two runs differing only in summation order agree to ~1e-10).
"""

from __future__ import annotations

import torch
from torch import Tensor


def at_least_float32(x: Tensor) -> Tensor:
    """`x` in float32, or in its own dtype where that is wider (float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
