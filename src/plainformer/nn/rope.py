"""Rotary position embedding (Su et al. 2021, RoFormer).

Each pair (x_i, x_{i+d/2}) of a query or key at position p is rotated by the angle p·θ_i with
θ_i = base^(-2i/d), i = 0 .. d/2-1 (the "rotate_half" layout):

    rope(x, p) = x ⊙ cos(p θ) + rotate_half(x) ⊙ sin(p θ),   rotate_half([x₁, x₂]) = [-x₂, x₁]

so that <rope(q, m), rope(k, n)> depends only on m - n, and norms are preserved.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from .. import _checks


def _swap_halves(x: Tensor) -> Tensor:
    """[x₁, x₂] -> [x₂, x₁] over the last axis."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((second, first), dim=-1)


class _Rotate(torch.autograd.Function):
    """rope(x) = x ⊙ cos + swap(x) ⊙ s̃ with s̃ = [-sin₁, sin₂] (= rotate_half(x) ⊙ sin), and its
    gradient, the inverse rotation Rᵀg = g ⊙ cos - swap(g) ⊙ s̃: three passes over x each way, where
    autograd through rotate_half makes about twice as many (memory-bound on CPU)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return torch.addcmul(x * cos, _swap_halves(x), signed_sin)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, signed_sin = ctx.saved_tensors
        return torch.addcmul(grad * cos, _swap_halves(grad), signed_sin, value=-1), None, None


class RotaryEmbedding(nn.Module):
    """Rotates (B, H, n, d) queries or keys for positions offset .. offset+n-1.
    validate_args=False skips the checks of the arguments (see `MultiHeadAttention`)."""

    cos: Tensor  # (max_len, d) buffers: cos(p θ) and s̃ = [-sin(p θ₁), sin(p θ₂)]
    signed_sin: Tensor

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0, *, validate_args: bool = True):
        super().__init__()
        if validate_args:
            _checks.check_positive_int("head_dim", head_dim)
            _checks.check_positive_int("max_len", max_len)
            if head_dim % 2:
                raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
            _checks.check_greater_than("base", _checks.check_positive_number("base", base), 1)
        self.head_dim, self.max_len, self.base = head_dim, max_len, base
        theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (d/2,)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), theta)  # (max_len, d/2)
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1).float(), persistent=False)  # (max_len, d)
        self.register_buffer("signed_sin", torch.cat((-sin, sin), dim=-1).float(), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """x: (B, H, n, d) -> same shape, rotated for positions offset .. offset+n-1.

        Not checked here, a hot path: `MultiHeadAttention.forward` checks head_dim and positions
        (`attention.check_rope`), the models check positions against their context length.
        """
        n = x.shape[-2]
        cos = self.cos[offset:offset + n].to(x.dtype)  # (n, d)
        signed_sin = self.signed_sin[offset:offset + n].to(x.dtype)
        return cast(Tensor, _Rotate.apply(x, cos, signed_sin))

    def at(self, positions: Tensor) -> RowRotation:
        """This rotation at `positions` (B, n), each row its own (a left-padded batch)."""
        return RowRotation(self, positions)


class RowRotation:
    """A `RotaryEmbedding` at given positions (B, n): rotates (B, H, n, d) queries or keys of a batch
    whose rows start at different positions. The angles are gathered once, for every layer; the
    `offset` the attention passes is already in the positions."""

    def __init__(self, rope: RotaryEmbedding, positions: Tensor):
        self.head_dim, self.max_len = rope.head_dim, rope.max_len
        self.cos = rope.cos[positions].unsqueeze(1)  # (B, 1, n, d)
        self.signed_sin = rope.signed_sin[positions].unsqueeze(1)

    def __call__(self, x: Tensor, offset: int = 0) -> Tensor:
        return cast(Tensor, _Rotate.apply(x, self.cos.to(x.dtype), self.signed_sin.to(x.dtype)))


#: What the attention layers take as `rope`.
Rotation = RotaryEmbedding | RowRotation
