"""A preallocated key/value cache for one attention layer.

Decoding one token at a time recomputes nothing for the past: the keys and values of earlier positions
are kept in buffers of shape (B, H_kv, max_len, d_k), written in place as positions arrive. A `static`
cache holds the keys and values of a fixed memory (cross-attention over the encoder output) that are
projected once per source and then reused at every decoding step.

A cache also keeps the token id of each row's newest position (`last_tokens`), for a model whose embedding
reads the previous token (GPT's token_shift and bigram_embedding): at the next step it is the predecessor of
the first new token.
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
        self._last = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,), see last_tokens
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

    def last_tokens(self) -> Tensor:
        """(B,) the token id at position length-1 of each row, as the model wrote it (`set_last_tokens`)."""
        return self._last

    def set_last_tokens(self, ids: Tensor) -> None:
        """Keep ids (B,) as the tokens of the newest positions."""
        self._last.copy_(ids)

    def reorder(self, batch_indices: Tensor, *, group_size: int | None = None) -> None:
        """Keep batch rows `batch_indices` (beam search picks which hypotheses survive).

        group_size (see `DecoderCache.reorder`) changes nothing here: every row is its own.
        """
        self._k = self._k.index_select(0, batch_indices)
        self._v = self._v.index_select(0, batch_indices)
        self._last = self._last.index_select(0, batch_indices)


class RowsKVCache(KVCache):
    """A `KVCache` whose rows come and go while a batch decodes (continuous batching).

    Buffers (max_rows, H_kv, max_len, d_k) are allocated once; the model sees the first `rows` of them.
    Every row's newest position is column length-1 (rows are right-aligned), so a row of n positions holds
    columns length-n .. length-1 and the columns before are padding that an attention mask hides.
    """

    def __init__(self, max_rows: int, n_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__(max_rows, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        # Zeroed, unlike a KVCache: a masked column still enters the product weights · V (as 0 · v), so it
        # must hold no NaN that uninitialised memory could.
        self._k_all, self._v_all, self._last_all = self._k.zero_(), self._v.zero_(), self._last
        self.resize(0)

    @classmethod
    def like(cls, cache: KVCache, max_rows: int) -> RowsKVCache:
        """A cache of max_rows rows with the heads, length, width, dtype and device of `cache`."""
        _, heads, max_len, head_dim = cache._k.shape
        return cls(max_rows, heads, max_len, head_dim, dtype=cache._k.dtype, device=cache._k.device)

    @property
    def rows(self) -> int:
        return self._k.shape[0]

    @property
    def device(self) -> torch.device:
        return self._k.device

    def resize(self, rows: int) -> None:
        """Decode with the first `rows` rows (those past it are free)."""
        self._k, self._v, self._last = self._k_all[:rows], self._v_all[:rows], self._last_all[:rows]

    def put(self, row: int, source: KVCache) -> None:
        """Copy the positions of `source` (a one-row cache) into `row`, ending at column length-1."""
        n = source.length
        self._k_all[row, :, self.length - n:self.length] = source.keys()[0]
        self._v_all[row, :, self.length - n:self.length] = source.values()[0]
        self._last_all[row] = source.last_tokens()[0]

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s positions into row `dst` (a finished row's slot is refilled by the last row)."""
        self._k_all[dst, :, :self.length] = self._k_all[src, :, :self.length]
        self._v_all[dst, :, :self.length] = self._v_all[src, :, :self.length]
        self._last_all[dst] = self._last_all[src]

    def shift(self, columns: int) -> None:
        """Move every row's positions `columns` to the right (> 0: room for a longer row before them)
        or to the left (< 0: padding that no row needs dropped); length changes by `columns`."""
        keep = self.length if columns > 0 else self.length + columns
        start = max(0, -columns)
        for buffer in (self._k, self._v):
            buffer[:, :, max(0, columns):max(0, columns) + keep] = buffer[:, :, start:start + keep].clone()
        self.length += columns
