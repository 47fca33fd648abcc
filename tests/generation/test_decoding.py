"""Sampling the next token (temperature, top-k, top-p) and the decoding loop's eos and argument handling."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import plainformer as pf
from plainformer.generation.decoding import generate_prompts, iter_generate, pad_prompts
from plainformer.generation.sampling import derived_seed
from plainformer.generation.stopping import StopStrings

DRAWS = 20_000


def _draw_frequencies(logits: torch.Tensor, seed: int = 0, **options) -> torch.Tensor:
    """Empirical distribution (V,) of DRAWS tokens drawn from one row of logits (V,)."""
    batch = logits.expand(DRAWS, -1)
    tokens = pf.sample_next(batch, generator=torch.Generator().manual_seed(seed), **options)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / DRAWS


def _assert_frequencies(frequencies: torch.Tensor, probabilities: torch.Tensor) -> None:
    """Each count within 5 binomial standard deviations of its expectation; zero where p = 0."""
    sigma = (probabilities * (1 - probabilities) / DRAWS).sqrt()
    assert bool(((frequencies - probabilities).abs() <= 5 * sigma + 1e-12).all()), (frequencies, probabilities)


# distinct logits a tenth apart at least: ties (kept together by top-k) are not what these tests probe
logits_rows = st.lists(st.integers(-100, 100), min_size=2, max_size=40, unique=True).map(
    lambda values: [v / 10 for v in values])


@settings(max_examples=50, deadline=None)
@given(logits_rows, st.integers(1, 4))
def test_temperature_zero_and_top_k_one_are_argmax(row, batch):
    logits = torch.tensor(row).repeat(batch, 1) + torch.arange(batch).unsqueeze(1)
    expected = logits.argmax(dim=-1)
    assert torch.equal(pf.sample_next(logits, temperature=0), expected)
    assert torch.equal(pf.sample_next(logits, temperature=0.7, top_k=1), expected)


@settings(max_examples=50, deadline=None)
@given(logits_rows, st.sampled_from([3e-38, 1e-300, 5e-324, 1e-30]))
def test_a_temperature_too_small_for_z_over_t_is_greedy_not_nan(row, temperature):
    # z / T overflows to +inf for these T (the float32 z / 3e-38 already does), and its softmax is NaN
    logits = torch.tensor([row, [v * 3 for v in row]])
    assert torch.equal(pf.sample_next(logits, temperature=temperature, generator=torch.Generator().manual_seed(0)),
                       logits.argmax(dim=-1))


def test_derived_seeds_wrap_at_2_to_the_64():
    assert [derived_seed(2**64 - 1, offset) for offset in range(3)] == [2**64 - 1, 0, 1]
    torch.Generator().manual_seed(derived_seed(2**64 - 1, 5))  # in the generator's range


def test_samples_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    for temperature in (1.0, 2.5, 0.5):
        _assert_frequencies(_draw_frequencies(logits, temperature=temperature),
                            torch.softmax(logits.double() / temperature, dim=-1))


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_top_k_keeps_exactly_the_k_largest_renormalised(k):
    logits = torch.tensor([0.3, 2.0, -1.0, 1.1, 0.9, -0.2, 1.6, 0.0])
    kept = torch.zeros(8, dtype=torch.bool)
    kept[logits.argsort(descending=True)[:k]] = True
    probabilities = torch.softmax(logits.double().masked_fill(~kept, float("-inf")), dim=-1)
    frequencies = _draw_frequencies(logits, top_k=k)
    assert torch.equal(frequencies > 0, kept)
    _assert_frequencies(frequencies, probabilities)


@pytest.mark.parametrize("top_p, kept", [
    (0.3, [0]), (0.5, [0]), (0.6, [0, 1]), (0.8, [0, 1, 2]), (0.9, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3, 4]),
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probabilities = torch.tensor([0.5, 0.25, 0.12, 0.08, 0.05], dtype=torch.float64)
    order = torch.tensor([3, 0, 4, 1, 2])  # shuffled, so the set is not a prefix of the vocabulary
    logits = torch.empty(5).scatter_(0, order, probabilities.log().float())
    kept_ids = order[kept]
    mask = torch.zeros(5, dtype=torch.bool)
    mask[kept_ids] = True
    expected = torch.zeros(5, dtype=torch.float64)
    expected[kept_ids] = probabilities[kept] / probabilities[kept].sum()
    frequencies = _draw_frequencies(logits, top_p=top_p)
    assert torch.equal(frequencies > 0, mask)
    _assert_frequencies(frequencies, expected)


@settings(max_examples=50, deadline=None)
@given(logits_rows, st.floats(0.05, 0.95))
def test_top_p_never_draws_outside_the_nucleus(row, top_p):
    logits = torch.tensor(row)
    probabilities = torch.softmax(logits.double(), dim=-1)
    sorted_p, order = probabilities.sort(descending=True)
    before = sorted_p.cumsum(0) - sorted_p  # mass of the more likely tokens
    nucleus = set(order[before < top_p - 1e-6].tolist())  # tokens within float error of p may go either way
    draws = pf.sample_next(logits.expand(200, -1), top_p=top_p, generator=torch.Generator().manual_seed(0))
    allowed = nucleus | set(order[(before - top_p).abs() <= 1e-6].tolist())
    assert set(draws.tolist()) <= allowed


def test_seeded_generator_gives_the_same_tokens():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    draw = [pf.sample_next(logits, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(seed))
            for seed in (3, 3, 4)]
    assert torch.equal(draw[0], draw[1])
    many = [pf.sample_next(logits.repeat(50, 1), generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
    assert not torch.equal(many[0], many[1])


@pytest.mark.parametrize("options, match", [
    (dict(temperature=-0.5), "temperature must be a number >= 0"),
    (dict(temperature="hot"), "temperature must be a number >= 0"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(top_k=2.0), "top_k must be an int"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
])
def test_bad_sampling_arguments_are_rejected_naming_them(options, match):
    logits = torch.zeros(1, 5)
    with pytest.raises((ValueError, TypeError), match=match):
        pf.sample_next(logits, **options)
    with pytest.raises((ValueError, TypeError), match=match):
        next(iter_generate(_Successor(), torch.zeros(1, 1, dtype=torch.long), 1, **options))


# ----------------------------------------------------------------------------- the decoding loop

class _Successor:
    """A stand-in model whose next token is certainly (last token + 1) mod V, with or without a cache."""

    block_size = 64
    vocab_size = 10

    def new_kv_caches(self, batch_size: int) -> list:
        return []

    def __call__(self, idx: torch.Tensor, *, kv_caches=None):
        logits = torch.full((*idx.shape, self.vocab_size), -1e4)
        logits.scatter_(-1, ((idx + 1) % self.vocab_size).unsqueeze(-1), 0.0)
        return logits, None


@pytest.mark.parametrize("use_cache", [True, False])
def test_rows_that_reached_eos_repeat_it_and_the_loop_stops_when_all_have(use_cache):
    prompts = torch.tensor([[1, 3], [7, 0]])
    steps = list(iter_generate(_Successor(), prompts, 20, temperature=0, eos_id=5, use_cache=use_cache))
    tokens = torch.stack([t for t, _ in steps], dim=1)
    # row 0 reaches eos at step 2 and is held there; row 1 at step 5, which ends the loop
    assert tokens.tolist() == [[4, 5, 5, 5, 5], [1, 2, 3, 4, 5]]
    assert all(z.shape == (2, 10) for _, z in steps)


class _NaNAfter(_Successor):
    """Like _Successor, but its logits turn NaN once the sequence reaches `length` tokens."""

    length = 3

    def __call__(self, idx: torch.Tensor, *, kv_caches=None):
        logits, _ = super().__call__(idx)
        return (logits * float("nan") if kv_caches is None and idx.shape[1] >= self.length else logits), None


@pytest.mark.parametrize("eos_id", [None, 9])
def test_sampling_from_nan_logits_stops_the_loop_with_a_clear_error(eos_id):
    steps = iter_generate(_NaNAfter(), torch.tensor([[1]]), 5, temperature=1.0, eos_id=eos_id, use_cache=False)
    assert next(steps)[0].tolist() == [2]
    with pytest.raises(ValueError, match=r"logits rows \[0\] hold NaN"):
        list(steps)


def test_without_eos_the_loop_runs_max_new_tokens():
    prompts = torch.tensor([[4]])
    assert pf.generate(_Successor(), prompts, 7, temperature=0).tolist() == [[4, 5, 6, 7, 8, 9, 0, 1]]
    assert torch.equal(pf.generate(_Successor(), prompts, 0), prompts)


@pytest.mark.parametrize("idx, max_new_tokens, match", [
    (torch.zeros(3, dtype=torch.long), 1, r"idx must have 2 dimensions \(B, n\)"),
    (torch.zeros(2, 0, dtype=torch.long), 1, "at least one prompt token"),
    (torch.zeros(1, 1, dtype=torch.long), -1, "max_new_tokens must be an int >= 0"),
    (torch.zeros(1, 1, dtype=torch.long), 2.0, "max_new_tokens must be an int >= 0"),
    (torch.zeros(1, 1, dtype=torch.long), True, "max_new_tokens must be an int >= 0"),
])
def test_bad_loop_arguments_are_rejected_naming_them(idx, max_new_tokens, match):
    with pytest.raises(ValueError, match=match):
        next(iter_generate(_Successor(), idx, max_new_tokens))


# ----------------------------------------------------------------------------- prompts of different lengths

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


def _tiny_gpt(pos_encoding: str, **variants) -> pf.GPT:
    torch.manual_seed(0)
    return pf.GPT(pf.GPTConfig(vocab_size=23, block_size=12, n_layers=2, n_heads=2, d_model=16, d_ff=32,
                               pos_encoding=pos_encoding, **variants)).eval()


def _alone(model, prompt, steps, **options):
    with torch.no_grad():
        drawn = list(iter_generate(model.decoder(), torch.tensor([prompt]), steps, **options))
    return torch.stack([t for t, _ in drawn], dim=1)[0], torch.stack([z for _, z in drawn], dim=1)[0]


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("pos_encoding, variants", [
    ("learned", {}), ("sinusoidal", {}), ("rope", {}), ("alibi", {}),
    ("rope", dict(sliding_window=4)), ("alibi", dict(sliding_window=5, qk_norm=True, attn_softcap=0.05)),
], ids=["learned", "sinusoidal", "rope", "alibi", "rope-window", "alibi-window-qk-norm-softcap"])
def test_prompts_of_different_lengths_decode_in_one_batch_as_each_alone(pos_encoding, variants, use_cache):
    """20 new tokens past block_size 12: every row's window slides on its own, at its own step (and its
    attention's sliding window, if any, moves along its own positions in a cache of that window)."""
    model = _tiny_gpt(pos_encoding, **variants)
    idx, pads = pad_prompts(PROMPTS)
    with torch.no_grad():
        drawn = list(iter_generate(model.decoder(), idx, 20, temperature=0, pads=pads, use_cache=use_cache))
    tokens, logits = torch.stack([t for t, _ in drawn], dim=1), torch.stack([z for _, z in drawn], dim=1)
    for row, prompt in enumerate(PROMPTS):
        alone_tokens, alone_logits = _alone(model, prompt, 20, temperature=0)
        assert torch.equal(tokens[row], alone_tokens)
        torch.testing.assert_close(logits[row], alone_logits, rtol=0, atol=1e-5)


def test_sampling_with_a_generator_per_row_draws_what_each_row_draws_alone():
    model = _tiny_gpt("rope")
    idx, pads = pad_prompts(PROMPTS)
    generators = [torch.Generator().manual_seed(seed) for seed in range(len(PROMPTS))]
    with torch.no_grad():
        drawn = [t for t, _ in iter_generate(model.decoder(), idx, 15, top_k=5, pads=pads, generator=generators)]
    tokens = torch.stack(drawn, dim=1)
    for row, prompt in enumerate(PROMPTS):
        alone, _ = _alone(model, prompt, 15, top_k=5, generator=torch.Generator().manual_seed(row))
        assert torch.equal(tokens[row], alone)


class _PaddedSuccessor(_Successor):
    """_Successor for padded rows: the next token depends on the last one only, so the mask changes nothing."""

    def __call__(self, idx: torch.Tensor, *, kv_caches=None, attention_mask=None):
        return super().__call__(idx)


def test_generate_prompts_ends_each_row_after_its_eos_and_returns_prompt_and_new_tokens():
    outputs = generate_prompts(_PaddedSuccessor(), [[1, 3], [7], [4, 4, 4]], 20, temperature=0, eos_id=5)
    assert outputs == [[1, 3, 4, 5], [7, 8, 9, 0, 1, 2, 3, 4, 5], [4, 4, 4, 5]]
    assert generate_prompts(_Successor(), [[2]], 3, temperature=0) == [[2, 3, 4, 5]]


def test_generate_prompts_ends_each_row_at_the_token_that_completes_a_stop_string():
    stop = StopStrings(lambda ids: "".join(map(str, ids)), ["45", "9"])
    outputs = generate_prompts(_PaddedSuccessor(), [[1], [6], [2, 2]], 20, temperature=0, stop=stop)
    assert outputs == [[1, 2, 3, 4, 5], [6, 7, 8, 9], [2, 2, 3, 4, 5]]


def test_a_gpt_generates_a_list_of_prompts_as_lists_and_refuses_what_does_not_fit():
    model = _tiny_gpt("learned")
    outputs = model.generate(PROMPTS, 6, temperature=0)
    assert [out[:len(p)] for out, p in zip(outputs, PROMPTS, strict=True)] == PROMPTS
    assert all(len(out) == len(p) + 6 for out, p in zip(outputs, PROMPTS, strict=True))
    assert outputs[0] == model.generate(torch.tensor([PROMPTS[0]]), 6, temperature=0)[0].tolist()
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        model.generate(PROMPTS, 2, stop=["x"])
    with pytest.raises(ValueError, match="give the prompts as a list"):
        model.generate(torch.tensor([[1, 2]]), 2, stop=["x"])
    with pytest.raises(ValueError, match=r"idx holds token ids outside \[0, 23\)|vocab"):
        model.generate([[1, 99]], 2)


@pytest.mark.parametrize("prompts, error, match", [
    ([], TypeError, "non-empty list of token-id lists"),
    ("abc", TypeError, "non-empty list"),
    ([[1], []], ValueError, r"prompts\[1\] is empty"),
    ([[1], ["a"]], TypeError, r"prompts\[1\] must be a list of token ids"),
    ([torch.zeros(2, 2, dtype=torch.long)], TypeError, r"prompts\[0\] must be a list of token ids or a 1-D"),
])
def test_bad_prompts_are_refused_naming_them(prompts, error, match):
    with pytest.raises(error, match=match):
        pad_prompts(prompts)


def test_pads_and_generators_must_fit_the_batch():
    with pytest.raises(ValueError, match="pads must give each of the 2 rows"):
        next(iter_generate(_Successor(), torch.zeros(2, 3, dtype=torch.long), 1, pads=[0, 3]))
    with pytest.raises(ValueError, match="one per row takes 2 generators, got 1"):
        next(iter_generate(_Successor(), torch.zeros(2, 3, dtype=torch.long), 1, generator=[torch.Generator()]))
