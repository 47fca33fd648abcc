"""What every part of the checkpoint format raises, and the one check of a saved tensor against the one
it is loaded into."""

from __future__ import annotations

from torch import Tensor


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupted or does not fit what it is loaded into."""


def check_like(where: str, saved: Tensor, expected: Tensor, *, exact_dtype: bool) -> None:
    """`saved` has `expected`'s shape, and its dtype (or, unless exact_dtype, another float dtype)."""
    if saved.shape != expected.shape:
        raise CheckpointError(f"{where} has shape {tuple(saved.shape)}, expected {tuple(expected.shape)}")
    same_kind = saved.is_floating_point() and expected.is_floating_point() and not exact_dtype
    if saved.dtype != expected.dtype and not same_kind:
        raise CheckpointError(f"{where} has dtype {saved.dtype}, expected {expected.dtype}")
