"""The prefix cache: a prompt that begins as one prefilled before reuses its keys and values and gets the same
tokens, log-probabilities and prompt scores as without the cache (≤ 1e-5, against the model's full forward
pass); entries leave least recently used first within the byte bound; a windowed model keeps none."""

from __future__ import annotations

import pytest
import torch

import plainformer as pf
from plainformer.generation.batching import ContinuousBatcher
from plainformer.generation.jobs import Job, PromptScores, Sampling, Token
from plainformer.generation.prefix_cache import Prefix, PrefixCache, default_capacity
from tests.generation.test_batching import Collector, RecordingDecoder, run_until_done
from tests.reference.tiny_models import GPT_VARIANTS_49, moved_off_start

VOCAB, BLOCK = 40, 64


def entry(tokens: list[int], width: int = 4, scored: int | None = None) -> Prefix:
    """An entry of 2 layers whose keys and values are `width` floats a position (2 · 2 · 4 · width bytes each)."""
    n = len(tokens)
    keys = [torch.zeros(1, n, width) for _ in range(2)]
    prefix = Prefix(tokens, keys, [k.clone() for k in keys])
    if scored is not None:
        prefix.logprobs = -torch.arange(1.0, n, dtype=torch.float64)
        prefix.top_ids = torch.arange(n - 1)[:, None].repeat(1, scored)
        prefix.top_logprobs = torch.zeros(n - 1, scored, dtype=torch.float64)
    return prefix


def test_a_prompt_reuses_the_longest_shared_prefix_but_never_its_last_token():
    cache = PrefixCache(10**6)
    cache.add(entry([1, 2, 3, 4, 5]))
    cache.add(entry([1, 2, 9]))
    found = cache.match([1, 2, 3, 4, 7, 7], None)
    assert found is not None and found[0].tokens == [1, 2, 3, 4, 5] and found[1] == 4
    assert cache.match([1, 2, 3], None)[1] == 2  # the whole prompt is cached: its last token is still run
    assert cache.match([5, 2, 3], None) is None
    assert cache.match([1], None) is None


def test_a_scored_prompt_reuses_only_a_scored_entry_with_as_many_alternatives_one_position_less():
    cache = PrefixCache(10**6)
    cache.add(entry([1, 2, 3, 4, 5, 6]))
    assert cache.match([1, 2, 3, 4, 8], 0) is None  # not scored
    cache.add(entry([1, 2, 3, 4, 5], scored=2))  # a prefix of the unscored one, scored: both stay
    assert len(cache) == 2
    found = cache.match([1, 2, 3, 4, 8], 2)
    assert found is not None and found[0].top_k == 2 and found[1] == 3
    assert cache.match([1, 2, 3, 4, 8], 3) is None
    logprobs, top = found[0].scores(3, 1)
    assert logprobs == [-1.0, -2.0, -3.0] and top == [[(0, 0.0)], [(1, 0.0)], [(2, 0.0)]]


def test_entries_leave_least_recently_used_first_within_the_byte_bound():
    size = entry([0] * 10).nbytes  # 2 layers · (keys + values) · 10 positions · 4 floats · 4 bytes
    assert size == 2 * 2 * 10 * 4 * 4
    cache = PrefixCache(3 * size)
    for first in (1, 2, 3):
        cache.add(entry([first] * 10))
    assert cache.match([1] * 10 + [0], None) is not None  # 1 is now the most recently used, 2 the least
    cache.add(entry([4] * 10))
    assert cache.nbytes == 3 * size <= cache.capacity
    assert cache.match([2] * 10 + [0], None) is None
    assert all(cache.match([t] * 10 + [0], None) is not None for t in (1, 3, 4))
    cache.add(entry([5] * 40))  # larger than the bound: not kept, nothing evicted for it
    assert len(cache) == 3 and cache.match([5] * 41, None) is None


def test_a_prompt_that_extends_an_entry_replaces_it_and_one_held_whole_adds_nothing():
    cache = PrefixCache(10**6)
    cache.add(entry([1, 2, 3]))
    cache.add(entry([1, 2, 3, 4]))
    assert len(cache) == 1 and cache.holds([1, 2, 3], None) and cache.holds([1, 2, 3, 4], None)
    assert not cache.holds([1, 2, 3], 1)  # scored prompts need a scored entry
    assert not cache.holds([1, 2, 3, 4, 5], None)
    assert cache.nbytes == entry([1, 2, 3, 4]).nbytes


def test_the_capacity_and_the_default_are_positive_byte_counts():
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(0)
    assert 1 <= default_capacity(torch.device("cpu")) <= 4 * 2**30


def model_of(**variants) -> pf.GPT:
    torch.manual_seed(0)
    config = pf.GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                          d_ff=64, **variants)
    return moved_off_start(pf.GPT(config)).eval()


def serve_all(model: pf.GPT, jobs: list[dict], cache_bytes: int, *, prefill_chunk: int = 512, together: bool = False
              ) -> tuple[list[Collector], ContinuousBatcher]:
    """Each job (Job's keyword arguments) through one batcher: one after another (each after the last ended,
    so that it can reuse them), or all submitted at once when `together`."""
    batcher = ContinuousBatcher(model.decoder(), max_rows=4, prefill_chunk=prefill_chunk,
                                prefix_cache_bytes=cache_bytes)
    batcher.start()
    collectors = []
    try:
        for spec in jobs:
            collectors.append(Collector(len(spec.get("seeds", [None]))))
            batcher.submit(Job(emit=collectors[-1], **spec))
            if not together:
                assert collectors[-1].done.wait(30)
        for collector in collectors:
            assert collector.done.wait(30)
    finally:
        batcher.stop()
    return collectors, batcher


def results(collector: Collector) -> tuple[list[int], torch.Tensor, PromptScores | None]:
    tokens = [e for e in collector.events if isinstance(e, Token)]
    scores = [e for e in collector.events if isinstance(e, PromptScores)]
    return [e.token for e in tokens], torch.tensor([e.logprob for e in tokens]), (scores[0] if scores else None)


def conversation(seed: int) -> list[dict]:
    """Prompts that share a 'system prompt' of 20 tokens and continue each other's (a chat's turns), an
    lm-eval-like context scored with 4 continuations, and an unrelated prompt."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    system, context = rand(20), rand(18)
    first = system + rand(5)
    jobs = [dict(prompt=first, max_new_tokens=6, sampling=Sampling(temperature=0.0), logprobs=0),
            dict(prompt=first + rand(4), max_new_tokens=5, sampling=Sampling(temperature=1.0), seeds=[3, 4],
                 logprobs=1),
            dict(prompt=system + rand(9), max_new_tokens=7, sampling=Sampling(temperature=0.8), seeds=[5],
                 logprobs=0),
            dict(prompt=rand(12), max_new_tokens=3, sampling=Sampling(temperature=0.0), logprobs=0)]
    for _ in range(4):
        jobs.append(dict(prompt=context + rand(3), max_new_tokens=1, sampling=Sampling(temperature=0.0), logprobs=1,
                         prompt_logprobs=2))
    return jobs


@pytest.mark.parametrize("variants", [
    dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu"),
    dict(pos_encoding="alibi", qk_norm=True, attn_softcap=0.05),
    dict(pos_encoding="learned"),
    dict(GPT_VARIANTS_49, pos_encoding="rope", norm="rmsnorm"),
], ids=["rope", "alibi", "learned", "every-issue-49-variant"])
@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
def test_with_and_without_the_cache_the_same_tokens_logprobs_and_prompt_scores(variants, together):
    model = model_of(**variants)
    jobs = conversation(seed=7)
    without, _ = serve_all(model, jobs, 0, together=together)
    cached, batcher = serve_all(model, jobs, 10**7, together=together, prefill_chunk=16)
    for plain, reused in zip(without, cached, strict=True):
        tokens, logprobs, scores = results(plain)
        tokens_c, logprobs_c, scores_c = results(reused)
        assert tokens_c == tokens
        torch.testing.assert_close(logprobs_c, logprobs, atol=1e-5, rtol=0)
        if scores is not None:
            assert scores_c is not None
            torch.testing.assert_close(torch.tensor(scores_c.logprobs), torch.tensor(scores.logprobs), atol=1e-5,
                                       rtol=0)
            assert [[t for t, _ in top] for top in scores_c.top] == [[t for t, _ in top] for top in scores.top]
    if not together:  # jobs 1, 2 reuse the system prompt; the last 3 continuations the scored context
        assert batcher.prefix_cache_hits == 5
        assert batcher.prefix_cache_hit_tokens == 25 + 20 + 3 * 17


def test_the_prompt_scores_of_a_reused_prefix_are_the_models_full_forward():
    model = model_of(**GPT_VARIANTS_49, pos_encoding="rope").double()
    jobs = conversation(seed=3)[4:]
    collectors, batcher = serve_all(model, jobs, 10**7)
    assert batcher.prefix_cache_hits == 3
    for spec, collector in zip(jobs, collectors, strict=True):
        prompt = spec["prompt"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt]))[0][0], dim=-1)  # (p, V)
        scores = results(collector)[2]
        expected = logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(scores.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)
        assert [[t for t, _ in top] for top in scores.top] == logp[:-1].topk(2, dim=-1).indices.tolist()
        assert results(collector)[0] == [int(logp[-1].argmax())]


def test_a_windowed_model_keeps_no_prefix_cache_and_zero_keeps_none():
    windowed = model_of(pos_encoding="rope", sliding_window=6)
    assert ContinuousBatcher(windowed.decoder(), prefix_cache_bytes=10**6).prefix_cache is None
    assert ContinuousBatcher(model_of().decoder(), prefix_cache_bytes=0).prefix_cache is None
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        ContinuousBatcher(model_of().decoder(), prefix_cache_bytes=-1)


@pytest.mark.parametrize("chunk", [512, 6], ids=["one-pass", "chunked"])
def test_a_padded_group_of_reused_prefixes_and_a_miss_scores_as_the_full_forward(chunk):
    # the three prompts wait together (submitted as the first one's last token is drawn): two reuse parts of
    # the first's prompt (the second 10 of the 12 tokens it shares), one shares nothing and has the most to run,
    # 9 tokens: the group runs its last 9 columns, a reused prefix right-aligned before them in each row that
    # has one, padding elsewhere
    model = model_of(**GPT_VARIANTS_49, pos_encoding="rope").double()
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    first = rand(30)
    prompts = [first + rand(6), first[:12] + rand(7), [(first[0] + 1) % VOCAB] + rand(8)]
    batcher = ContinuousBatcher(model.decoder(), max_rows=4, prefill_chunk=chunk, prefix_cache_bytes=10**7)
    collectors = [Collector() for _ in prompts]

    def on_first(event) -> None:
        if isinstance(event, Token):
            for prompt, collector in zip(prompts, collectors, strict=True):
                batcher.submit(Job(prompt, 5, collector, sampling=Sampling(temperature=0.0), logprobs=0))

    batcher.submit(Job(first, 1, on_first, sampling=Sampling(temperature=0.0)))
    run_until_done(batcher, collectors)
    assert batcher.prefix_cache_hits == 2 and batcher.prefix_cache_hit_tokens == (36 - 9) + (19 - 9)
    for prompt, collector in zip(prompts, collectors, strict=True):
        tokens, logprobs, _ = results(collector)
        with torch.no_grad():
            full = model(torch.tensor([prompt + tokens[:-1]]))[0][0, len(prompt) - 1:]  # (new, V)
        logp = torch.log_softmax(full, dim=-1)
        assert tokens == full.argmax(-1).tolist()
        torch.testing.assert_close(logprobs.double(), logp.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-5,
                                   rtol=0)


def test_prompts_that_reuse_a_long_prefix_are_prefilled_before_one_that_reuses_none():
    # 3 prompts reuse 30 tokens and run 3 or 4, the fourth runs 33: one pass would run 4 x 33 columns, the 3
    # first and the fourth after run 3 x 4 + 33; each gets what it gets alone
    model = model_of(**GPT_VARIANTS_49, pos_encoding="rope").double()
    decoder = RecordingDecoder(model.decoder())
    g = torch.Generator().manual_seed(12)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    first = rand(30)
    prompts = [first + rand(3), [(first[0] + 1) % VOCAB] + rand(32), first + rand(4), first + rand(3)]
    batcher = ContinuousBatcher(decoder, max_rows=4, prefix_cache_bytes=10**7)
    collectors = [Collector() for _ in prompts]

    def on_first(event) -> None:
        if isinstance(event, Token):
            decoder.shapes.clear()
            for prompt, collector in zip(prompts, collectors, strict=True):
                batcher.submit(Job(prompt, 3, collector, sampling=Sampling(temperature=0.0), logprobs=0))

    batcher.submit(Job(first, 1, on_first, sampling=Sampling(temperature=0.0)))
    run_until_done(batcher, collectors)
    assert decoder.shapes[:3] == [(3, 4), (3, 1), (1, 33)]  # the reusing three, their step, then the other
    assert batcher.prefix_cache_hits == 3
    for prompt, collector in zip(prompts, collectors, strict=True):
        tokens, logprobs, _ = results(collector)
        with torch.no_grad():
            full = model(torch.tensor([prompt + tokens[:-1]]))[0][0, len(prompt) - 1:]  # (new, V)
        assert tokens == full.argmax(-1).tolist()
        torch.testing.assert_close(logprobs.double(), torch.log_softmax(full, -1).max(-1).values, atol=1e-5, rtol=0)
