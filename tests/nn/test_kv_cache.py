"""KVCache and RowsKVCache: rows put right-aligned, moved into a freed slot, and every row shifted right or left;
a sliding window's rolling cache holding its last positions; each row's newest token id kept through all of it;
checked position by position against plain tensors."""

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


def test_a_padded_rows_cache_gives_its_rows_last_n_columns_and_writes_and_reads_columns():
    # a prefill's cache of 2 rows, 5 columns, left-padded: row 1 holds 3 positions, its last token 6
    prompts = RowsKVCache.like(KVCache(1, 2, 8, 3), max_rows=2, max_len=5)
    assert prompts.max_len == 5 and prompts.capacity == 5
    prompts.resize(2)
    keys = torch.arange(10, dtype=torch.float32).view(2, 1, 5, 1).expand(2, 2, 5, 3)
    prompts.append(keys, -keys)
    prompts.set_last_tokens(torch.tensor([4, 6]))
    batch = RowsKVCache.like(KVCache(1, 2, 8, 3), max_rows=2)
    batch.length = 4
    batch.resize(1)
    batch.put(0, prompts, source_row=1, n=3)
    assert torch.equal(batch.keys()[0, :, 1:], keys[1, :, 2:])
    assert torch.equal(batch.values()[0, :, 1:], -keys[1, :, 2:])
    assert batch.keys()[0, :, 0].abs().sum() == 0 and batch.last_tokens().tolist() == [6]
    read_keys, read_values = prompts.read(0, 1, 3)
    assert torch.equal(read_keys, keys[0, :, 1:4]) and torch.equal(read_values, -keys[0, :, 1:4])
    batch.write(0, 0, read_keys, read_values)  # a copy: the source keeps its own
    prompts.write(0, 1, torch.zeros(2, 3, 3), torch.zeros(2, 3, 3))
    assert torch.equal(batch.keys()[0, :, :3], keys[0, :, 1:4]) and prompts.keys()[0, :, 1:4].abs().sum() == 0


# ----------------------------------------------------------------------------- a sliding window's rolling cache
# Each position's key is its own number (repeated over heads and d_k), so a tensor of keys reads as positions.

def positions(n: int, start: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32).repeat(batch, 2, 3, 1).transpose(2, 3)  # (B, 2, n, 3)


def held_positions(keys: torch.Tensor) -> list[int]:
    return keys[0, 0, :, 0].long().tolist()


def test_a_window_cache_holds_the_last_w_positions_and_returns_what_the_new_queries_see():
    cache = KVCache(1, 2, 20, 3, window=4)
    assert cache.capacity == 4 and cache._k.shape == (1, 2, 4, 3)
    seen = []
    for start, n in ((0, 3), (3, 1), (4, 1), (5, 3), (8, 1), (9, 6)):
        assert cache.attended(n) == min(cache.held, 3) + n
        keys, values = cache.append(positions(n, start), -positions(n, start))
        seen.append(held_positions(keys))
        assert torch.equal(values, -keys)
        assert cache.length == start + n and cache.held == min(start + n, 4)
        assert held_positions(cache.keys()) == list(range(start + n - cache.held, start + n))
    # in place while they fit; then the w - 1 = 3 positions before the new ones, and the new ones
    assert seen == [[0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5, 6, 7], [5, 6, 7, 8],
                    [6, 7, 8, 9, 10, 11, 12, 13, 14]]


def test_a_window_longer_than_max_len_changes_nothing():
    cache = KVCache(1, 2, 6, 3, window=10)
    cache.append(positions(4), positions(4))
    assert cache.capacity == 6 and held_positions(cache.append(positions(2, 4), positions(2, 4))[0]) == list(range(6))


def test_window_rows_hold_the_last_columns_right_aligned_through_put_move_and_shift():
    """Rows of a window w = 4 hold columns length - held .. length-1: a put row keeps its newest position last,
    a shift right (a longer row joins) keeps the newest held ones, a shift left drops the oldest."""
    window = KVCache(1, 2, 12, 3, window=4)
    cache = RowsKVCache.like(window, max_rows=3)
    assert cache.window == 4 and cache.capacity == 4 and cache._k_all.abs().sum() == 0
    long, short = KVCache(1, 2, 12, 3, window=4), KVCache(1, 2, 12, 3, window=4)
    long.append(positions(6), positions(6))  # holds 2 .. 5
    short.append(positions(2, 100), positions(2, 100))  # holds 100, 101
    cache.length = 6
    for slot, source in enumerate((long, short)):
        cache.resize(slot + 1)
        cache.put(slot, source)
    assert held_positions(cache.keys()[:1]) == [2, 3, 4, 5] and held_positions(cache.keys()[1:, :, 2:]) == [100, 101]
    keys, _ = cache.append(positions(1, 6, batch=2), positions(1, 6, batch=2))  # one step of both rows
    assert held_positions(keys[:1]) == [3, 4, 5, 6] and held_positions(keys[1:, :, 1:]) == [100, 101, 6]
    assert cache.length == 7 and held_positions(cache.keys()[:1]) == [3, 4, 5, 6]
    cache.shift(3)  # a 10-position row joins: the held columns stay the newest
    assert cache.length == 10 and held_positions(cache.keys()[:1]) == [3, 4, 5, 6]
    cache.shift(-8)  # every row's first 8 columns are padding: 2 held columns remain
    assert cache.length == 2 and held_positions(cache.keys()[:1]) == [5, 6]
    cache.move(1, 0)
    assert held_positions(cache.keys()[:1]) == [101, 6]


def test_shifting_short_window_rows_right_moves_them_like_a_full_cache():
    cache = RowsKVCache(2, 2, 12, 3, window=4)
    cache.length = 2
    cache.resize(1)
    cache.put(0, one_row(2, 10.0))
    cache.shift(1)  # 3 columns: the two positions move one to the right, below the window's capacity
    assert cache.held == 3 and held_positions(cache.keys()[:, :, 1:]) == [10, 11]
