"""RowsKVCache: rows put right-aligned, moved into a freed slot, and every row shifted right or left, checked
position by position against plain tensors; each row's newest token id kept through all of it."""

from __future__ import annotations

import torch

from plainformer.nn.kv_cache import KVCache, RowsKVCache


def one_row(n: int, fill: float) -> KVCache:
    cache = KVCache(1, 2, 8, 3)
    keys = torch.arange(n, dtype=torch.float32).repeat(1, 2, 3, 1).transpose(2, 3) + fill  # (1, 2, n, 3)
    cache.append(keys, -keys)
    return cache


def test_rows_are_right_aligned_moved_and_shifted():
    cache = RowsKVCache.like(KVCache(1, 2, 8, 3), max_rows=4)
    assert cache.rows == 0 and cache._k_all.abs().sum() == 0  # zeroed: masked columns are read as 0 * v
    cache.length = 3
    first, second = one_row(3, 100.0), one_row(2, 200.0)
    for slot, source in enumerate((first, second)):
        cache.resize(slot + 1)
        cache.put(slot, source)
    assert torch.equal(cache.keys()[0], first.keys()[0])
    assert torch.equal(cache.keys()[1, :, 1:], second.keys()[0]) and torch.equal(cache.values()[1, :, 1:],
                                                                                   second.values()[0])
    before = cache.keys().clone()
    cache.shift(2)  # room for a prompt of 5 before the rows
    assert cache.length == 5 and torch.equal(cache.keys()[:, :, 2:], before)
    cache.shift(-2)
    assert cache.length == 3 and torch.equal(cache.keys(), before)
    cache.move(1, 0)
    cache.resize(1)
    assert cache.rows == 1 and torch.equal(cache.keys()[0], before[1])


def test_each_rows_newest_token_follows_it_through_put_move_shift_and_reorder():
    cache = RowsKVCache.like(KVCache(1, 2, 8, 3), max_rows=4)
    cache.length = 3
    for slot, (n, token) in enumerate(((3, 7), (2, 9), (1, 4))):
        source = one_row(n, 0.0)
        source.set_last_tokens(torch.tensor([token]))
        cache.resize(slot + 1)
        cache.put(slot, source)
    assert cache.last_tokens().tolist() == [7, 9, 4]
    cache.shift(2)
    cache.shift(-1)
    assert cache.last_tokens().tolist() == [7, 9, 4]  # the newest position stays each row's last column
    cache.set_last_tokens(torch.tensor([1, 2, 3]))  # a decoding step wrote its tokens
    cache.move(2, 0)
    cache.resize(2)
    assert cache.last_tokens().tolist() == [3, 2]
    beams = KVCache(3, 2, 8, 3)
    beams.set_last_tokens(torch.tensor([5, 6, 8]))
    beams.reorder(torch.tensor([2, 2, 0]))
    assert beams.last_tokens().tolist() == [8, 8, 5]
