"""Continuous batching: rows that join a running batch and leave it draw exactly what they draw alone
(greedy and seeded), prompts are scored as the model's log-softmax, and cancelled rows free their slots."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import plainformer as pf
from plainformer.generation.batching import ContinuousBatcher, Job, PromptScores, QueueFull, Sampling, Token
from plainformer.generation.stopping import StopStrings

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


@pytest.mark.parametrize("variants", [
    dict(pos_encoding="alibi", sliding_window=6, qk_norm=True, attn_softcap=0.05),
    dict(pos_encoding="rope", norm="rmsnorm", sliding_window=5, backend="sdpa"),
], ids=["alibi-window-qk-norm-softcap", "rope-window-sdpa"])
def test_rows_of_a_windowed_model_draw_what_they_draw_alone(variants):
    """The attention variants through the shared cache: its rows keep only the window's last positions, and
    ALiBi and the window follow each row's own positions."""
    torch.manual_seed(0)
    windowed = pf.GPT(pf.GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layers=2, n_heads=4, n_kv_heads=2,
                                   d_model=32, d_ff=64, **variants)).eval()
    with torch.no_grad():  # peaked distributions: a wrong logit changes the tokens drawn
        for parameter in windowed.parameters():
            parameter.mul_(8.0 if parameter.ndim > 1 else 1.0)
    running = ContinuousBatcher(windowed.decoder(), max_rows=3, max_queue=32)
    assert running._caches[0].capacity == variants["sliding_window"]
    prompts = random_prompts(7, seed=4)
    settings = [(0.0 if i % 2 else 1.0, 8 + (5 * i) % 17) for i in range(len(prompts))]
    collectors = [Collector() for _ in prompts]
    running.start()
    try:
        for i, (prompt, (temperature, new)) in enumerate(zip(prompts, settings, strict=True)):
            running.submit(Job(prompt, new, collectors[i], sampling=Sampling(temperature=temperature), seeds=[50 + i]))
        for collector in collectors:
            assert collector.done.wait(30)
    finally:
        running.stop()
    for i, (prompt, (temperature, new)) in enumerate(zip(prompts, settings, strict=True)):
        assert collectors[i].tokens() == alone(windowed, prompt, new, temperature, 50 + i), i


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
