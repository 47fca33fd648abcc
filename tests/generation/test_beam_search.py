"""generation.beam_search: beam size 1 is greedy decoding; with a beam wide enough to keep every
hypothesis it finds the sequence of best length-penalised score (checked by enumeration); the KV cache
changes nothing; padded batches decode as their rows alone; any model of the decoding protocol works.

The models are float64, so that two of our paths (cached or not, batched or alone) agree whatever order
the CPU's kernels sum in (scores to 1e-10)."""

from __future__ import annotations

import itertools

import pytest
import torch

from plainformer.generation.beam_search import beam_search, length_penalty_factor
from plainformer.generation.decoding import generate
from plainformer.models.gpt import GPT, GPTConfig
from plainformer.models.transformer import Transformer, TransformerConfig

EOS = 2
SCORE_TOLERANCE = 1e-10  # float64 scores of two of our paths


def _gpt(vocab: int = 11, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=vocab, block_size=12, n_layers=2, n_heads=2, d_model=16, d_ff=32)
    model = GPT(config).double().eval()
    with torch.no_grad():  # GPT-2's N(0, 0.02) init gives near-uniform next-token distributions
        model.token_embedding.weight.normal_(std=1.0)
    return model


def _transformer(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig(src_vocab_size=13, tgt_vocab_size=13, n_layers=2, n_heads=2, d_model=16,
                               d_ff=32, dropout=0.0, max_len=16, pad_id=0, bos_id=1, eos_id=EOS)
    return Transformer(config).double().eval()


def _sources() -> torch.Tensor:
    return torch.tensor([[5, 6, 7, 8, 9], [3, 4, 10, 0, 0], [11, 12, 0, 0, 0]])


def _bos(batch: int) -> torch.Tensor:
    return torch.ones(batch, 1, dtype=torch.long)


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_size_one_equals_greedy_for_a_transformer(use_cache):
    bound = _transformer().bind(_sources())
    greedy = generate(bound, _bos(3), 10, temperature=0.0, eos_id=EOS, use_cache=use_cache)
    beam, _ = beam_search(bound, _bos(3), 10, beam_size=1, eos_id=EOS, use_cache=use_cache)
    assert torch.equal(beam, greedy)


def test_beam_size_one_equals_greedy_for_a_gpt():
    model = _gpt()
    prompt = torch.tensor([[3, 4], [5, 5]])
    with torch.no_grad():
        greedy = generate(model, prompt, 8, temperature=0.0, eos_id=EOS)
        beam, _ = beam_search(model, prompt, 8, beam_size=1, eos_id=EOS)
    assert torch.equal(beam, greedy)


@pytest.mark.parametrize("beam_size", [2, 4])
def test_decoding_with_the_kv_cache_equals_decoding_without(beam_size):
    bound = _transformer(seed=1).bind(_sources())
    cached, cached_scores = beam_search(bound, _bos(3), 12, beam_size=beam_size, eos_id=EOS)
    plain, plain_scores = beam_search(bound, _bos(3), 12, beam_size=beam_size, eos_id=EOS, use_cache=False)
    assert torch.equal(cached, plain)
    assert torch.allclose(cached_scores, plain_scores, rtol=0, atol=SCORE_TOLERANCE)


def _up_to_eos(row: torch.Tensor) -> list[int]:
    tokens = row.tolist()
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_a_padded_batch_decodes_as_its_rows_alone():
    model = _transformer(seed=2)
    src = _sources()
    batched, batched_scores = beam_search(model.bind(src), _bos(3), 12, beam_size=3, eos_id=EOS)
    for row in range(3):
        alone = src[row:row + 1, :int((src[row] != 0).sum())]
        single, single_score = beam_search(model.bind(alone), _bos(1), 12, beam_size=3, eos_id=EOS)
        assert _up_to_eos(batched[row]) == _up_to_eos(single[0])
        assert abs(batched_scores[row].item() - single_score.item()) <= SCORE_TOLERANCE


def _sequence_log_prob(model: GPT, prompt: list[int], continuation: tuple[int, ...]) -> float:
    tokens = torch.tensor([prompt + list(continuation)])
    log_p = torch.log_softmax(model(tokens[:, :-1])[0].double(), dim=-1)[0]  # (n - 1, V)
    return sum(log_p[len(prompt) - 1 + i, token].item() for i, token in enumerate(continuation))


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_a_beam_keeping_every_hypothesis_finds_the_best_penalised_sequence(alpha):
    """Every finished sequence (EOS last) and every unfinished one of the maximum length, scored
    log P(Y) / lp(Y) by enumeration; a beam of V^L keeps all hypotheses, so it must find the best."""
    vocab, steps, prompt = 4, 3, [0, 3]
    model = _gpt(vocab=vocab, seed=3)
    candidates = []
    for length in range(1, steps + 1):
        for tokens in itertools.product(range(vocab), repeat=length):
            if EOS in tokens[:-1] or (length < steps and tokens[-1] != EOS):
                continue
            score = _sequence_log_prob(model, prompt, tokens) / ((5 + length) / 6) ** alpha
            candidates.append((score, tokens))
    best_score, best_tokens = max(candidates)
    with torch.no_grad():
        found, score = beam_search(model, torch.tensor([prompt]), steps, beam_size=vocab ** steps,
                                   length_penalty=alpha, eos_id=EOS)
    assert tuple(_up_to_eos(found[0, len(prompt):])) == best_tokens
    assert abs(score.item() - best_score) <= 1e-5


def test_a_sentence_whose_beams_all_ended_leaves_the_batch_and_keeps_its_result():
    model = _transformer()
    with torch.no_grad():
        model.output.weight[EOS] *= 1.5  # the second sentence's beams all end by step 3, the others run to 12
    sources = _sources()
    bound = model.bind(sources)
    rows_seen = []

    def counting(idx, **kwargs):
        rows_seen.append(idx.shape[0])
        return bound(idx, **kwargs)

    with torch.no_grad():
        batched, scores = beam_search(_Calls(bound, counting), _bos(3), 12, beam_size=3, eos_id=EOS)
        for i in range(3):
            alone, score = beam_search(model.bind(sources[i:i + 1]), _bos(1), 12, beam_size=3, eos_id=EOS)
            ended = alone.shape[1]
            assert torch.equal(batched[i, :ended], alone[0]) and (batched[i, ended:] == EOS).all()
            assert abs(scores[i].item() - score.item()) <= SCORE_TOLERANCE
    assert rows_seen[:3] == [9, 9, 9] and set(rows_seen[3:]) == {6}  # 3 sentences x 3 beams, then 2 x 3


class _Calls:
    """A bound decoder whose calls go through `call` (to watch the rows each step decodes)."""

    def __init__(self, bound, call):
        self.bound, self.call, self.block_size = bound, call, bound.block_size

    def __call__(self, idx, **kwargs):
        return self.call(idx, **kwargs)

    def new_kv_caches(self, batch_size):
        return self.bound.new_kv_caches(batch_size)

    def keep_sources(self, indices):
        self.bound.keep_sources(indices)


def test_length_penalty_is_gnmt_lp():
    lengths = torch.tensor([1.0, 4.0, 10.0])
    expected = torch.tensor([1.0, 1.5 ** 0.6, 2.5 ** 0.6])
    assert torch.allclose(length_penalty_factor(lengths, 0.6), expected)
    assert torch.equal(length_penalty_factor(lengths, 0.0), torch.ones(3))


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_size=0), "beam_size"),
    (dict(length_penalty=-1.0), "length_penalty"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=17), "block_size"),
])
def test_bad_arguments_raise_value_errors(kwargs, match):
    bound = _transformer().bind(_sources())
    options = {**dict(max_new_tokens=4, beam_size=2, eos_id=EOS), **kwargs}
    with pytest.raises(ValueError, match=match):
        beam_search(bound, _bos(3), options.pop("max_new_tokens"), **options)
    with pytest.raises(ValueError, match="idx"):
        beam_search(bound, torch.ones(3, 0, dtype=torch.long), 4)
