"""A preallocated key/value cache for one attention layer.

Decoding one token at a time recomputes nothing for the past: the keys and values of earlier positions
are kept in buffers of shape (B, H_kv, max_len, d_k), written in place as positions arrive. A `static`
cache holds the keys and values of a fixed memory (cross-attention over the encoder output) that are
projected once per source and then reused at every decoding step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks


class KVCache:
    """Keys and values of positions 0 .. length-1, in buffers (B, H_kv, max_len, d_k).
    validate_args=False skips the checks of the sizes (a model that checked them builds its caches)."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 static: bool = False, validate_args: bool = True):
        if validate_args:
            for name, value in (("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                                ("max_len", max_len), ("head_dim", head_dim)):
                _checks.check_positive_int(name, value)
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        # Uninitialised: only positions 0 .. length-1, written before they are read, are ever read.
        self._k = torch.empty(shape, dtype=dtype, device=device)
        self._v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len, self.static = max_len, static
        self.length = 0

    def check_fits(self, name: str, shape: tuple[int, ...]) -> None:
        """Keys or values of `shape` (B, H_kv, n, d_k) can be appended: checked once, at the boundary."""
        batch, heads, _, head_dim = self._k.shape
        if len(shape) != 4 or (shape[0], shape[1], shape[3]) != (batch, heads, head_dim):
            raise ValueError(f"{name} must have shape (B, H_kv, n, d_k) = ({batch}, {heads}, n, "
                             f"{head_dim}) to fit the cache, got {tuple(shape)}")
        self._check_room(shape[2])

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H_kv, n, d_k) at positions length .. length+n-1; return all (B, H_kv, length, d_k).

        Shapes are not checked here, on the decoding path (see `check_fits`); room is.
        """
        n = k.shape[-2]
        self._check_room(n)
        self._k[:, :, self.length:self.length + n] = k
        self._v[:, :, self.length:self.length + n] = v
        self.length += n
        return self.keys(), self.values()

    def _check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache is full: {self.length} cached + {n} new positions exceed "
                             f"max_len={self.max_len}")

    def keys(self) -> Tensor:
        return self._k[:, :, :self.length]

    def values(self) -> Tensor:
        return self._v[:, :, :self.length]

    def reorder(self, batch_indices: Tensor, *, group_size: int | None = None) -> None:
        """Keep batch rows `batch_indices` (beam search picks which hypotheses survive).

        group_size (see `DecoderCache.reorder`) changes nothing here: every row is its own.
        """
        self._k = self._k.index_select(0, batch_indices)
        self._v = self._v.index_select(0, batch_indices)
