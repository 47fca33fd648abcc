"""A preallocated key/value cache for one attention layer.

Decoding one token at a time recomputes nothing for the past: the keys and values of earlier positions
are kept in buffers of shape (B, H_kv, max_len, d_k), written in place as positions arrive. A `static`
cache holds the keys and values of a fixed memory (cross-attention over the encoder output) that are
projected once per source and then reused at every decoding step.

A cache also keeps the token id of each row's newest position (`last_tokens`), for a model whose embedding
reads the previous token (GPT's token_shift and bigram_embedding): at the next step it is the predecessor of
the first new token.

The cache of a sliding-window attention (`window` w: each query sees the last w positions, itself
included) is a rolling one: its buffers hold only the last w positions. New positions are appended in
place while they fit; past that, the n new keys attend together with the w - 1 positions before them
(all the first of them sees), and the last w of those are kept, in order, the oldest dropped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks


class KVCache:
    """Keys and values of positions 0 .. length-1 (at most max_len), in buffers (B, H_kv, capacity, d_k):
    all of them, or with a `window` w the last `held` = min(length, w) (capacity min(max_len, w)).
    validate_args=False skips the checks of the sizes (a model that checked them builds its caches)."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 static: bool = False, window: int | None = None, validate_args: bool = True):
        if validate_args:
            for name, value in (("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                                ("max_len", max_len), ("head_dim", head_dim)):
                _checks.check_positive_int(name, value)
            if window is not None:
                _checks.check_positive_int("window", window)
                if static:
                    raise ValueError("a static cache holds a whole memory: it takes no window")
        self.capacity = max_len if window is None else min(max_len, window)
        shape = (batch_size, n_kv_heads, self.capacity, head_dim)
        # Uninitialised: only positions 0 .. held-1, written before they are read, are ever read.
        self._k = torch.empty(shape, dtype=dtype, device=device)
        self._v = torch.empty(shape, dtype=dtype, device=device)
        self._last = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,), see last_tokens
        self.max_len, self.static, self.window = max_len, static, window
        self.length = 0
        self._spare: tuple[Tensor, Tensor] | None = None  # the buffers a reorder writes into (`reorder`)

    @property
    def held(self) -> int:
        """Positions in the buffers, the newest last: length - held .. length-1."""
        return min(self.length, self.capacity)

    def attended(self, n: int) -> int:
        """How many keys `append` of n new positions returns: the held ones and the new ones, or with a
        window past its capacity the w - 1 positions before the new ones and the new ones."""
        if self.window is None or self.held + n <= self.capacity:
            return self.held + n
        return min(self.held, self.window - 1) + n

    def check_fits(self, name: str, shape: tuple[int, ...]) -> None:
        """Keys or values of `shape` (B, H_kv, n, d_k) can be appended: checked once, at the boundary."""
        batch, heads, _, head_dim = self._k.shape
        if len(shape) != 4 or (shape[0], shape[1], shape[3]) != (batch, heads, head_dim):
            raise ValueError(f"{name} must have shape (B, H_kv, n, d_k) = ({batch}, {heads}, n, "
                             f"{head_dim}) to fit the cache, got {tuple(shape)}")
        self._check_room(shape[2])

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H_kv, n, d_k) at positions length .. length+n-1; return the keys and values the
        n new queries attend, (B, H_kv, `attended(n)`, d_k), in order, the new ones last.

        Shapes are not checked here, on the decoding path (see `check_fits`); room is.
        """
        n, held = k.shape[-2], self.held
        self._check_room(n)
        if self.window is None or held + n <= self.capacity:
            self._k[:, :, held:held + n] = k
            self._v[:, :, held:held + n] = v
            self.length += n
            return self.keys(), self.values()
        before = held - min(held, self.window - 1)  # the held positions no new query sees
        keys = torch.cat((self._k[:, :, before:held], k), dim=2)
        values = torch.cat((self._v[:, :, before:held], v), dim=2)
        self.length += n
        kept = self.held
        self._k[:, :, :kept] = keys[:, :, -kept:]
        self._v[:, :, :kept] = values[:, :, -kept:]
        return keys, values

    def _check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache is full: {self.length} cached + {n} new positions exceed "
                             f"max_len={self.max_len}")

    def keys(self) -> Tensor:
        """The held keys (B, H_kv, held, d_k), positions length - held .. length-1."""
        return self._k[:, :, :self.held]

    def values(self) -> Tensor:
        return self._v[:, :, :self.held]

    def last_tokens(self) -> Tensor:
        """(B,) the token id at position length-1 of each row, as the model wrote it (`set_last_tokens`)."""
        return self._last

    def set_last_tokens(self, ids: Tensor) -> None:
        """Keep ids (B,) as the tokens of the newest positions."""
        self._last.copy_(ids)

    def reorder(self, batch_indices: Tensor, *, group_size: int | None = None, whole_groups: int | None = None
                ) -> None:
        """Keep batch rows `batch_indices` (beam search picks which hypotheses survive).

        group_size and whole_groups (see `DecoderCache.reorder`) change nothing here: every row is its own.
        Only the held positions are moved, straight into a second pair of buffers that then takes the first's
        place (a beam reorders at every step: one pass over what it has decoded, not over the capacity).
        """
        held, rows = self.held, len(batch_indices)
        if self._k.requires_grad or self._v.requires_grad:  # under autograd (a test's): a reorder autograd follows
            self._k, self._v = self._k.index_select(0, batch_indices), self._v.index_select(0, batch_indices)
            self._last = self._last.index_select(0, batch_indices)
            return
        if self._spare is None or self._spare[0].shape[0] != rows:
            self._spare = (self._k.new_empty((rows, *self._k.shape[1:])), self._v.new_empty((rows, *self._v.shape[1:])))
        spare_k, spare_v = self._spare
        torch.index_select(self._k[:, :, :held], 0, batch_indices, out=spare_k[:, :, :held])
        torch.index_select(self._v[:, :, :held], 0, batch_indices, out=spare_v[:, :, :held])
        self._spare = (self._k, self._v) if self._k.shape[0] == rows else None
        self._k, self._v = spare_k, spare_v
        self._last = self._last.index_select(0, batch_indices)


class RowsKVCache(KVCache):
    """A `KVCache` whose rows come and go while a batch decodes (continuous batching).

    Buffers (max_rows, H_kv, capacity, d_k) are allocated once; the model sees the first `rows` of them.
    Every row's newest position is column length-1 (rows are right-aligned), so a row of n positions holds
    columns length-n .. length-1 and the columns before are padding that an attention mask hides. With a
    window, the buffers hold the last `held` columns, length - held .. length-1, as a `KVCache` does.
    """

    def __init__(self, max_rows: int, n_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 window: int | None = None):
        super().__init__(max_rows, n_kv_heads, max_len, head_dim, dtype=dtype, device=device, window=window)
        # Zeroed, unlike a KVCache: a masked column still enters the product weights · V (as 0 · v), so it
        # must hold no NaN that uninitialised memory could.
        self._k_all, self._v_all, self._last_all = self._k.zero_(), self._v.zero_(), self._last
        self.resize(0)

    @classmethod
    def like(cls, cache: KVCache, max_rows: int, max_len: int | None = None) -> RowsKVCache:
        """A cache of max_rows rows with the heads, window, width, dtype and device of `cache`, and its
        max_len or `max_len` (a batch of prompts of at most that many columns)."""
        _, heads, _, head_dim = cache._k.shape
        return cls(max_rows, heads, cache.max_len if max_len is None else max_len, head_dim, dtype=cache._k.dtype,
                   device=cache._k.device, window=cache.window)

    @property
    def rows(self) -> int:
        return self._k.shape[0]

    @property
    def device(self) -> torch.device:
        return self._k.device

    def resize(self, rows: int) -> None:
        """Decode with the first `rows` rows (those past it are free)."""
        self._k, self._v, self._last = self._k_all[:rows], self._v_all[:rows], self._last_all[:rows]

    def put(self, row: int, source: KVCache, source_row: int = 0, n: int | None = None) -> None:
        """Copy the newest n held positions (default all) of row `source_row` of `source` (no longer than
        this cache) into `row`, ending at column length-1."""
        n, held = source.held if n is None else n, self.held
        self._k_all[row, :, held - n:held] = source.keys()[source_row, :, source.held - n:]
        self._v_all[row, :, held - n:held] = source.values()[source_row, :, source.held - n:]
        self._last_all[row] = source.last_tokens()[source_row]

    def write(self, row: int, column: int, keys: Tensor, values: Tensor) -> None:
        """Store keys and values (H_kv, n, d_k) of `row` at buffer columns column .. column+n-1 (a prefix
        computed before, `read` from another cache; no window: a buffer column is then a position)."""
        n = keys.shape[1]
        self._k_all[row, :, column:column + n] = keys
        self._v_all[row, :, column:column + n] = values

    def read(self, row: int, column: int, n: int) -> tuple[Tensor, Tensor]:
        """A copy of the keys and values (H_kv, n, d_k) of `row` at buffer columns column .. column+n-1."""
        return (self._k_all[row, :, column:column + n].clone(), self._v_all[row, :, column:column + n].clone())

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s positions into row `dst` (a finished row's slot is refilled by the last row)."""
        self._k_all[dst, :, :self.held] = self._k_all[src, :, :self.held]
        self._v_all[dst, :, :self.held] = self._v_all[src, :, :self.held]
        self._last_all[dst] = self._last_all[src]

    def shift(self, columns: int) -> None:
        """Move every row's positions `columns` to the right (> 0: room for a longer row before them)
        or to the left (< 0: padding that no row needs dropped); length changes by `columns`. A held
        position stays where it is relative to the newest one; past a window's capacity that moves it
        by less than `columns` in the buffer, or not at all."""
        held = self.held
        self.length += columns
        move = self.held - held  # where the newest held position goes: held - 1 + move
        keep = held if move >= 0 else held + move
        start = max(0, -move)
        for buffer in (self._k, self._v):
            buffer[:, :, max(0, move):max(0, move) + keep] = buffer[:, :, start:start + keep].clone()
