"""Continuous batching: rows that join a running batch and leave it draw exactly what they draw alone
(greedy and seeded), prompts are scored as the model's log-softmax, and cancelled rows free their slots."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import plainformer as pf
from plainformer.generation.batching import ContinuousBatcher, QueueFull
from plainformer.generation.jobs import Failed, Job, PromptScores, Sampling, Token
from plainformer.generation.stopping import StopStrings
from tests.reference.tiny_models import GPT_VARIANTS_49, moved_off_start

VOCAB, BLOCK = 40, 48


@pytest.fixture(scope="module")
def model() -> pf.GPT:
    torch.manual_seed(0)
    config = pf.GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                          d_ff=64, pos_encoding="rope", norm="rmsnorm", activation="swiglu")
    return pf.GPT(config).eval()


class Collector:
    """A job's events, and an Event set once each of its rows has finished."""

    def __init__(self, rows: int = 1):
        self.events: list = []
        self.open = rows
        self.done = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, Token) and event.finish is not None:
            self.open -= 1
            if not self.open:
                self.done.set()

    def tokens(self, choice: int = 0) -> list[int]:
        return [e.token for e in self.events if isinstance(e, Token) and e.choice == choice]


def run_until_done(batcher: ContinuousBatcher, collectors: list[Collector]) -> None:
    """Start the batcher, wait for every collector's rows to finish, and stop it."""
    batcher.start()
    try:
        for collector in collectors:
            assert collector.done.wait(30)
    finally:
        batcher.stop()


def alone(model: pf.GPT, prompt: list[int], new: int, temperature: float, seed: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), new, temperature=temperature,
                         generator=torch.Generator().manual_seed(seed))
    return out[0, len(prompt):].tolist()


def random_prompts(count: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (count,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def batcher(model):
    running = ContinuousBatcher(model.decoder(), max_rows=4, max_queue=32)
    running.start()
    yield running
    running.stop()


def test_rows_that_join_and_leave_draw_what_they_draw_alone(model, batcher):
    # 12 jobs of mixed lengths for 4 rows: the batch fills, rows leave, waiting jobs join; the cache shifts
    # right for longer prompts and is compacted when it reaches block_size
    prompts = random_prompts(12)
    settings = [(0.0 if i % 3 == 0 else 1.0, 10 + (7 * i) % 20) for i in range(len(prompts))]
    collectors = []
    for i, (prompt, (temperature, new)) in enumerate(zip(prompts, settings, strict=True)):
        collectors.append(Collector())
        batcher.submit(Job(prompt, new, collectors[-1], sampling=Sampling(temperature=temperature), seeds=[100 + i]))
    for collector in collectors:
        assert collector.done.wait(30)
    for i, (prompt, (temperature, new)) in enumerate(zip(prompts, settings, strict=True)):
        assert collectors[i].tokens() == alone(model, prompt, new, temperature, 100 + i), i
    assert batcher.active_rows == 0


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_rows_of_a_model_with_every_issue_49_variant_score_their_tokens_as_its_full_forward(moe):
    """Every row's tokens (greedy: the full pass's argmax) and their log-probabilities are those of the model's
    full forward pass over the row alone (float64 model): the value residual's first-layer values, the previous
    token of token shift and bigram, and the soft-capped logits all survive joining, leaving and compaction."""
    torch.manual_seed(0)
    config = pf.GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64,
                          pos_encoding="rope", norm="rmsnorm", **GPT_VARIANTS_49,
                          **(dict(n_experts=4, top_k=2) if moe else {}))
    model = moved_off_start(pf.GPT(config)).double().eval()
    batcher = ContinuousBatcher(model.decoder(), max_rows=3, max_queue=16)
    jobs = []
    for i, prompt in enumerate(random_prompts(7, seed=4)):
        rows = 2 if i == 3 else 1
        jobs.append((prompt, rows, Collector(rows), 0.0 if i % 2 else 1.0))
        batcher.submit(Job(prompt, 6 + (5 * i) % 18, jobs[-1][2], sampling=Sampling(temperature=jobs[-1][3]),
                           seeds=[10 + i + r for r in range(rows)], logprobs=0))
    batcher.start()
    try:
        for _, _, collector, _ in jobs:
            assert collector.done.wait(60)
    finally:
        batcher.stop()
    for prompt, rows, collector, temperature in jobs:
        for row in range(rows):
            tokens = collector.tokens(row)
            logprobs = [e.logprob for e in collector.events if isinstance(e, Token) and e.choice == row]
            with torch.no_grad():
                full = model(torch.tensor([prompt + tokens[:-1]]))[0][0, len(prompt) - 1:]  # (new, V)
            logp = torch.log_softmax(full.float(), dim=-1)
            expected = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)
            if temperature == 0.0:
                assert tokens == full.argmax(-1).tolist()


@pytest.mark.parametrize("variants", [
    dict(pos_encoding="alibi", sliding_window=6, qk_norm=True, attn_softcap=0.05),
    dict(pos_encoding="rope", norm="rmsnorm", sliding_window=5, backend="sdpa"),
    dict(GPT_VARIANTS_49, pos_encoding="alibi", sliding_window=6, qk_norm=True, attn_softcap=0.05),
], ids=["alibi-window-qk-norm-softcap", "rope-window-sdpa", "every-issue-49-variant"])
def test_rows_of_a_windowed_model_draw_what_they_draw_alone(variants):
    """The attention variants through the shared cache: its rows keep only the window's last positions, and
    ALiBi and the window follow each row's own positions."""
    torch.manual_seed(0)
    windowed = pf.GPT(pf.GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layers=2, n_heads=4, n_kv_heads=2,
                                   d_model=32, d_ff=64, **variants)).eval()
    with torch.no_grad():  # peaked distributions: a wrong logit changes the tokens drawn
        for parameter in windowed.parameters():
            parameter.mul_(8.0 if parameter.ndim > 1 else 1.0)
    # prompts prefilled 3 together in chunks of 2 columns, past the window: its cache rolls between chunks
    running = ContinuousBatcher(windowed.decoder(), max_rows=3, max_queue=32, prefill_chunk=6)
    assert running._caches[0].capacity == variants["sliding_window"]
    prompts = random_prompts(7, seed=4)
    settings = [(0.0 if i % 2 else 1.0, 8 + (5 * i) % 17) for i in range(len(prompts))]
    collectors = [Collector() for _ in prompts]
    for i, (prompt, (temperature, new)) in enumerate(zip(prompts, settings, strict=True)):
        running.submit(Job(prompt, new, collectors[i], sampling=Sampling(temperature=temperature), seeds=[50 + i]))
    run_until_done(running, collectors)
    for i, (prompt, (temperature, new)) in enumerate(zip(prompts, settings, strict=True)):
        assert collectors[i].tokens() == alone(windowed, prompt, new, temperature, 50 + i), i


class RecordingDecoder:
    """The model's decoder, recording the shape (B, n) of every forward pass's tokens."""

    def __init__(self, decoder):
        self.decoder, self.block_size, self.shapes = decoder, decoder.block_size, []

    def new_kv_caches(self, batch_size):
        return self.decoder.new_kv_caches(batch_size)

    def __call__(self, idx, **kwargs):
        self.shapes.append(tuple(idx.shape))
        return self.decoder(idx, **kwargs)

    def all_logits(self, idx, **kwargs):
        self.shapes.append(tuple(idx.shape))
        return self.decoder.all_logits(idx, **kwargs)


def test_prompts_that_wait_are_prefilled_together_in_one_forward_pass(model):
    decoder = RecordingDecoder(model.decoder())
    batcher = ContinuousBatcher(decoder, max_rows=5)
    prompts = random_prompts(4, seed=9)
    collectors = [Collector(rows=2 if i == 1 else 1) for i in range(4)]
    for i, prompt in enumerate(prompts):  # before the batcher starts: all wait at its first turn
        batcher.submit(Job(prompt, 6, collectors[i], sampling=Sampling(temperature=0.0 if i % 2 else 1.0),
                           seeds=[20 + i, 40] if i == 1 else [20 + i]))
    run_until_done(batcher, collectors)
    assert decoder.shapes[0] == (4, max(map(len, prompts)))  # 4 prompts, left-padded, one pass
    assert decoder.shapes[1:] == [(5, 1)] * 5  # then 5 steps of the 5 rows
    for i, prompt in enumerate(prompts):
        assert collectors[i].tokens() == alone(model, prompt, 6, 0.0 if i % 2 else 1.0, 20 + i), i
    assert collectors[1].tokens(1) == alone(model, prompts[1], 6, 0.0, 40)


def test_prefill_tokens_admits_the_waiting_prompts_a_pass_holds_and_the_rest_to_the_next(model):
    """prefill_tokens 8: of four 3-token prompts two share a pass (2 x 3 <= 8 < 3 x 3), the next two the next
    pass, after the first two's step; each still draws what it draws alone."""
    decoder = RecordingDecoder(model.decoder())
    batcher = ContinuousBatcher(decoder, max_rows=4, prefill_tokens=8)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    collectors = [Collector() for _ in prompts]
    for i, prompt in enumerate(prompts):  # before the batcher starts: all wait at its first turn
        batcher.submit(Job(prompt, 3, collectors[i], sampling=Sampling(temperature=1.0), seeds=[i]))
    run_until_done(batcher, collectors)
    assert decoder.shapes[:3] == [(2, 3), (2, 1), (2, 3)]
    for i, prompt in enumerate(prompts):
        assert collectors[i].tokens() == alone(model, prompt, 3, 1.0, i), i


def test_a_long_prompt_is_prefilled_in_chunks_between_the_steps_of_the_decoding_rows(model):
    decoder = RecordingDecoder(model.decoder())
    batcher = ContinuousBatcher(decoder, max_rows=2, prefill_chunk=4)
    decoding, long = Collector(), Collector()
    started = threading.Event()

    def on_decoding(event) -> None:
        decoding(event)
        started.set()

    prompt = torch.randint(0, VOCAB, (36,), generator=torch.Generator().manual_seed(5)).tolist()
    batcher.start()
    try:
        batcher.submit(Job([1, 2], 20, on_decoding, sampling=Sampling(temperature=0.0)))
        assert started.wait(30)
        batcher.submit(Job(prompt, 4, long, sampling=Sampling(temperature=1.0), seeds=[8]))
        assert long.done.wait(30) and decoding.done.wait(30)
    finally:
        batcher.stop()
    chunks = [i for i, shape in enumerate(decoder.shapes) if shape == (1, 4)]
    assert len(chunks) == 9  # 36 columns, 4 at a time, each chunk followed by a step of the decoding row
    assert all(decoder.shapes[i + 1] == (1, 1) for i in chunks[:-1])
    assert long.tokens() == alone(model, prompt, 4, 1.0, 8)
    assert decoding.tokens() == alone(model, [1, 2], 20, 0.0, 0)


def test_prompt_scores_of_a_padded_chunked_prefill_are_the_models_log_softmax(model):
    prompts = random_prompts(3, seed=6)
    batcher = ContinuousBatcher(model.decoder(), max_rows=3, prefill_chunk=7)
    collectors = [Collector() for _ in prompts]
    for prompt, collector in zip(prompts, collectors, strict=True):
        batcher.submit(Job(prompt, 1, collector, prompt_logprobs=2, sampling=Sampling(temperature=0.0)))
    run_until_done(batcher, collectors)
    for prompt, collector in zip(prompts, collectors, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt]))[0][0].double(), dim=-1)  # (p, V)
        scores = collector.events[0]
        expected = logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(scores.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)
        assert [[t for t, _ in row] for row in scores.top] == logp[:-1].topk(2, dim=-1).indices.tolist()


def test_a_job_of_n_rows_draws_seed_plus_row_for_each(model, batcher):
    collector = Collector(rows=3)
    batcher.submit(Job([3, 1, 4], 12, collector, sampling=Sampling(temperature=0.9, top_k=10), seeds=[7, 8, 9]))
    assert collector.done.wait(30)
    for row in range(3):
        expected = model.generate(torch.tensor([[3, 1, 4]]), 12, temperature=0.9, top_k=10,
                                  generator=torch.Generator().manual_seed(7 + row))[0, 3:].tolist()
        assert collector.tokens(row) == expected


def test_a_job_joins_the_running_batch_within_a_step_or_two(model):
    batcher = ContinuousBatcher(model.decoder(), max_rows=4)
    long, short = Collector(), Collector()
    started = threading.Event()

    def on_long(event) -> None:
        long(event)
        started.set()

    batcher.start()
    try:
        batcher.submit(Job([1, 2], BLOCK - 2, on_long, sampling=Sampling(temperature=0.0)))
        assert started.wait(30)
        batcher.submit(Job([5], 3, short, sampling=Sampling(temperature=0.0)))
        assert short.done.wait(30)
        assert not long.done.is_set()  # the short job finished while the long one decoded
        assert long.done.wait(30)
    finally:
        batcher.stop()
    assert batcher.steps < BLOCK  # the short job's steps were the long one's, not steps of their own


def test_prompt_scores_are_the_models_log_softmax(model, batcher):
    prompt = random_prompts(1, seed=3)[0]
    collector = Collector()
    batcher.submit(Job(prompt, 1, collector, prompt_logprobs=3, logprobs=2, sampling=Sampling(temperature=0.0)))
    assert collector.done.wait(30)
    scores, token = collector.events[0], collector.events[1]
    assert isinstance(scores, PromptScores)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]))[0][0].double(), dim=-1)  # (p, V)
    expected = logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(scores.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)
    top_ids = [[t for t, _ in row] for row in scores.top]
    assert top_ids == logp[:-1].topk(3, dim=-1).indices.tolist()
    assert token.token == int(logp[-1].argmax())
    assert token.logprob == pytest.approx(float(logp[-1].max()), abs=1e-5)
    assert [t for t, _ in token.top] == logp[-1].topk(2).indices.tolist()


def test_eos_and_stop_strings_end_a_row_with_stop(model, batcher):
    greedy = alone(model, [2, 3], 20, 0.0, 0)
    eos = Collector()
    batcher.submit(Job([2, 3], 20, eos, eos_id=greedy[4], sampling=Sampling(temperature=0.0)))
    decode = lambda ids: "".join(chr(65 + t % 26) for t in ids)  # noqa: E731  # a stand-in tokenizer
    stop = Collector()
    batcher.submit(Job([2, 3], 20, stop, stop=StopStrings(decode, [decode(greedy[5:7])]),
                       sampling=Sampling(temperature=0.0)))
    assert eos.done.wait(30) and stop.done.wait(30)
    assert eos.tokens() == greedy[:greedy.index(greedy[4]) + 1] and eos.events[-1].finish == "stop"
    text = decode(greedy)
    assert decode(stop.tokens()).find(decode(greedy[5:7])) == text.find(decode(greedy[5:7]))
    assert stop.events[-1].finish == "stop"


def test_cancelled_rows_leave_at_the_next_step(model, batcher):
    collector = Collector()
    job = Job([1], BLOCK - 1, collector, sampling=Sampling(temperature=0.0))

    def cancel_after_three(event) -> None:
        collector(event)
        if len(collector.events) == 3:
            job.cancelled = True

    job.emit = cancel_after_three
    batcher.submit(job)
    finished = Collector()
    batcher.submit(Job([2], 2, finished, sampling=Sampling(temperature=0.0)))
    assert finished.done.wait(30)
    deadline = time.monotonic() + 10
    while batcher.active_rows and time.monotonic() < deadline:  # the cancelled row leaves at the next turn
        time.sleep(0.01)
    assert batcher.active_rows == 0 and len(collector.tokens()) < BLOCK - 1


def test_submit_refuses_what_cannot_fit_and_a_full_queue(model):
    batcher = ContinuousBatcher(model.decoder(), max_rows=2, max_queue=1)  # not started: jobs wait
    with pytest.raises(ValueError, match="exceed the context of 48"):
        batcher.submit(Job([1] * 40, 9, Collector()))
    with pytest.raises(ValueError, match="1 to 2 rows"):
        batcher.submit(Job([1], 1, Collector(), seeds=[1, 2, 3]))
    batcher.submit(Job([1], 1, Collector()))
    with pytest.raises(QueueFull, match="--max-queue 1"):
        batcher.submit(Job([1], 1, Collector()))


def test_a_tiny_temperature_decodes_greedily_beside_a_sampled_row(model, batcher):
    sampled, tiny = Collector(), Collector()
    batcher.submit(Job([3, 1, 4], 20, sampled, sampling=Sampling(temperature=1.0), seeds=[5]))
    batcher.submit(Job([2, 7], 20, tiny, sampling=Sampling(temperature=3e-38), seeds=[6]))
    assert sampled.done.wait(30) and tiny.done.wait(30)
    assert sampled.tokens() == alone(model, [3, 1, 4], 20, 1.0, 5)
    assert tiny.tokens() == alone(model, [2, 7], 20, 0.0, 0)
    assert not [e for e in sampled.events + tiny.events if isinstance(e, Failed)]


class PoisonedDecoder:
    """The model's decoder, rigged: after token TRIGGER the next token is POISON for certain, after POISON the
    logits are NaN (what a broken row gives), and elsewhere neither is drawn (their logits are -inf)."""

    TRIGGER, POISON = 0, 1

    def __init__(self, decoder):
        self.decoder = decoder
        self.block_size = decoder.block_size

    def new_kv_caches(self, batch_size):
        return self.decoder.new_kv_caches(batch_size)

    def __call__(self, idx, **kwargs):
        logits, caches = self.decoder(idx, **kwargs)  # (B, n, V)
        last = idx[:, -1:, None]  # (B, 1, 1)
        logits = logits.clone()
        logits[..., [self.TRIGGER, self.POISON]] = float("-inf")
        certain = torch.full_like(logits, float("-inf")).index_fill(-1, torch.tensor([self.POISON]), 0.0)
        logits = torch.where(last == self.TRIGGER, certain, logits)
        return logits.masked_fill(last == self.POISON, float("nan")), caches

    def all_logits(self, idx, **kwargs):
        return self.decoder.all_logits(idx, **kwargs)


def _decode(decoder, jobs: list[tuple[Job, Collector]]) -> None:
    batcher = ContinuousBatcher(decoder, max_rows=4)
    for job, _ in jobs:
        batcher.submit(job)
    batcher.start()
    try:
        assert jobs[0][1].done.wait(30)
    finally:
        batcher.stop()
    assert batcher.active_rows == 0


def test_a_row_without_a_distribution_fails_its_own_job_alone(model):
    decoder = PoisonedDecoder(model.decoder())
    alone_, healthy, at_prefill, at_step = Collector(), Collector(), Collector(rows=2), Collector()
    _decode(decoder, [(Job([2, 3], 30, alone_, sampling=Sampling(temperature=1.0), seeds=[3]), alone_)])
    _decode(decoder, [(Job([2, 3], 30, healthy, sampling=Sampling(temperature=1.0), seeds=[3]), healthy),
                      (Job([5, decoder.POISON], 30, at_prefill, sampling=Sampling(temperature=0.7), seeds=[1, 2]),
                       at_prefill),
                      (Job([5, decoder.TRIGGER], 30, at_step, sampling=Sampling(temperature=1e-30), seeds=[0]),
                       at_step)])
    assert healthy.tokens() == alone_.tokens() and healthy.events[-1].finish == "length"
    assert [type(e) for e in at_prefill.events] == [Failed]
    assert [type(e) for e in at_step.events] == [Token, Failed] and at_step.tokens() == [decoder.POISON]
    assert "NaN or +inf" in at_step.events[-1].message


def test_a_cancelled_waiting_job_frees_its_queue_place_at_once(model):
    batcher = ContinuousBatcher(model.decoder(), max_rows=1, max_queue=1)  # not started: jobs wait
    leaving = Job([1], 1, Collector())
    batcher.submit(leaving)
    batcher.cancel(leaving)
    assert batcher.queued == 0 and leaving.cancelled
    batcher.submit(Job([1], 1, Collector()))  # the place it held
    assert batcher.queued == 1


def _biased_alone(model: pf.GPT, prompt: list[int], new: int, bias: dict[int, float]) -> tuple[list[int], list[float]]:
    """Greedy decoding of z + bias one token at a time by full forwards in float64, and log-softmax(z + bias)
    of each token drawn: the reference for a biased row."""
    ids, logprobs = list(prompt), []
    add = torch.zeros(VOCAB, dtype=torch.float64)
    for token, b in bias.items():
        add[token] += b
    with torch.no_grad():
        for _ in range(new):
            logp = torch.log_softmax(model(torch.tensor([ids]))[0][0, -1].double() + add, dim=-1)
            ids.append(int(logp.argmax()))
            logprobs.append(float(logp.max()))
    return ids[len(prompt):], logprobs


def test_logit_bias_forces_bans_and_is_in_the_reported_logprobs(model, batcher):
    prompt, new = [2, 3, 5], 8
    greedy = alone(model, prompt, new, 0.0, 0)
    cases = [{7: 100.0}, {greedy[0]: -100.0, greedy[1]: -100.0}, {4: 3.5, 9: -2.0}]
    collectors = [Collector(2) for _ in cases]  # two rows each, beside an unbiased job
    plain = Collector()
    for bias, collector in zip(cases, collectors, strict=True):
        batcher.submit(Job(prompt, new, collector, sampling=Sampling(temperature=0.0, logit_bias=tuple(bias.items())),
                           seeds=[0, 1], logprobs=0))
    batcher.submit(Job(prompt, new, plain, sampling=Sampling(temperature=0.0)))
    for collector in [*collectors, plain]:
        assert collector.done.wait(30)
    assert plain.tokens() == greedy  # a neighbour's bias is its own
    assert collectors[0].tokens() == [7] * new  # +100 forces
    assert greedy[0] not in collectors[1].tokens() and greedy[1] not in collectors[1].tokens()  # -100 bans
    for bias, collector in zip(cases, collectors, strict=True):
        tokens, logprobs = _biased_alone(model, prompt, new, bias)
        for choice in (0, 1):
            assert collector.tokens(choice) == tokens
            reported = [e.logprob for e in collector.events if isinstance(e, Token) and e.choice == choice]
            assert reported == pytest.approx(logprobs, abs=1e-5)


@pytest.mark.parametrize("pair", [(-1, 1.0), (3, 100.5), (3, float("nan")), (3, -101)])
def test_a_logit_bias_outside_its_range_is_refused(pair):
    with pytest.raises(ValueError, match="logit_bias"):
        Sampling(logit_bias=(pair,))
