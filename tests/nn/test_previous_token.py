"""nn/previous_token.py: each position's predecessor (none at a sequence's start, after padding, or before an
empty cache) against a loop over the positions; the token shift σ(g) ⊙ E[x_{t−1}] and the exact bigram row
B[x_{t−1} · V + x_t] against their equations in float64; float64 gradcheck of the gate. A whole GPT with them
is in tests/models/test_gpt.py."""

from __future__ import annotations

import torch

from plainformer.nn.previous_token import BigramEmbedding, TokenShift, previous_tokens
from tests.reference.torch_reference import assert_close


def _loop_reference(full: list[list[int]], real: list[list[bool]], offset: int) -> list[list[int | None]]:
    """For positions offset.. of each row of `full` (every position, cached ones too): the id before, None
    where there is none or it is padding."""
    return [[row[t - 1] if t > 0 and mask[t - 1] else None for t in range(offset, len(row))]
            for row, mask in zip(full, real, strict=True)]


def _check(full: torch.Tensor, real: torch.Tensor, offset: int, *, give_mask: bool) -> None:
    last = full[:, offset - 1] if offset else None
    ids, has = previous_tokens(full[:, offset:], offset, last, real if give_mask else None)
    ours = [[i if h else None for i, h in zip(row, flags, strict=True)]
            for row, flags in zip(ids.tolist(), has.tolist(), strict=True)]
    assert ours == _loop_reference(full.tolist(), real.tolist(), offset)


def test_each_position_reads_the_token_before_it_and_the_first_none():
    full = torch.randint(9, (3, 7), generator=torch.Generator().manual_seed(0))
    real = torch.ones(3, 7, dtype=torch.bool)
    for offset in (0, 1, 4):
        _check(full, real, offset, give_mask=False)
        _check(full, real, offset, give_mask=True)


def test_a_padding_predecessor_is_none_before_and_after_a_cache():
    full = torch.randint(9, (3, 7), generator=torch.Generator().manual_seed(0))
    real = torch.arange(7)[None, :] >= torch.tensor([0, 2, 5])[:, None]  # left padding of 0, 2, 5
    for offset in (0, 1, 3, 6):
        _check(full, real, offset, give_mask=True)


def test_token_shift_adds_the_gated_predecessor_embedding_where_there_is_one():
    shift = TokenShift(4).double()
    assert shift.gate.abs().sum() == 0  # σ(0) = 1/2 at start
    with torch.no_grad():
        shift.gate.copy_(torch.tensor([-1.0, 0.0, 2.0, 0.5]))
    previous = torch.randn(2, 3, 4, dtype=torch.float64)
    has = torch.tensor([[False, True, True], [True, False, True]])
    expected = 1 / (1 + torch.exp(-shift.gate.detach())) * previous * has[..., None].double()
    assert_close(shift(previous, has), expected)


def test_bigram_embedding_reads_the_row_of_the_pair_and_starts_at_zero():
    bigram = BigramEmbedding(5, 3).double()
    assert bigram.table.weight.shape == (25, 3) and bigram.table.weight.abs().sum() == 0
    with torch.no_grad():
        bigram.table.weight.copy_(torch.randn(25, 3, dtype=torch.float64))
    idx, previous = torch.tensor([[1, 4, 0]]), torch.tensor([[3, 1, 4]])
    has = torch.tensor([[False, True, True]])
    table = bigram.table.weight.detach()
    expected = torch.stack([torch.zeros(3, dtype=torch.float64), table[1 * 5 + 4], table[4 * 5 + 0]])[None]
    assert_close(bigram(idx, previous, has), expected)


def test_float64_gradcheck_of_the_token_shift_gate():
    shift = TokenShift(4).double()
    gate = torch.randn(4, dtype=torch.float64, requires_grad=True)
    previous = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    has = torch.tensor([[False, True, True], [True, True, False]])
    assert torch.autograd.gradcheck(
        lambda gate, previous: torch.func.functional_call(shift, {"gate": gate}, (previous, has)), (gate, previous))
