"""Continuous batching: requests join a decoding batch while it runs and leave it when done (Orca, Yu et
al. 2022), each row drawing exactly the tokens it would draw alone.

One thread owns the model (`run`, or `start` for a thread of its own). Each turn it admits waiting
requests, then advances every row by one token:

    prefill    a new request's prompt (1, p) runs alone, with a cache of its own: its first token is drawn
               from exactly the logits it would get alone, and its keys and values are copied into the
               batch's cache (every one of its `n` rows starts from them);
    step       the rows' newest tokens (B, 1) run as one batch over the shared cache (`RowsKVCache`):
               rows are right-aligned, row b holding columns L - n_b .. L - 1, and the attention mask
               (B, L + 1) hides the columns before them, so each row attends its own tokens and counts its
               positions from its own first token (`nn.masks.padded_positions_and_mask`);
    leave      a row that drew its eos, completed a stop string, reached max_new_tokens or was cancelled
               frees its slot at once (the last row moves into it).

Each row samples with its own settings and generator (`draw_next`; a seed s gives the draws of
`plainformer sample --seed s`), and reports log-softmax(z) of the token it drew and the top
alternatives when asked (z: the logits plus the row's logit_bias, as OpenAI reports them, before
temperature or truncation). A request's prompt plus
max_new_tokens must fit block_size: the context never slides here.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from .. import _checks
from ..nn.kv_cache import KVCache, RowsKVCache
from .sampling import check_sampling, draw_next
from .stopping import StopStrings

#: (token id, its log-probability) pairs, most likely first.
TopLogprobs = list[tuple[int, float]]


class BatchDecoder(Protocol):
    """What the batcher drives: `adapters.GPTDecoder`."""

    block_size: int

    def new_kv_caches(self, batch_size: int) -> list[Any]: ...

    def __call__(self, idx: Tensor, *, kv_caches: list[Any] | None = None,
                 attention_mask: Tensor | None = None) -> tuple[Tensor, Any]: ...

    def all_logits(self, idx: Tensor, *, kv_caches: list[Any] | None = None) -> Tensor: ...


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a row draws: `draw_next`'s settings; seed None = a fresh random generator. logit_bias: (token id,
    b) pairs, b in [-100, 100] added to that token's logit before anything else (OpenAI's logit_bias)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        for token, bias in self.logit_bias:
            if not _checks.is_int(token) or token < 0 or not (_checks.is_number(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias must pair token ids >= 0 with biases in [-100, 100], got "
                                 f"({token!r}, {bias!r})")


@dataclasses.dataclass(frozen=True)
class Token:
    """One token a row drew, with its log-probability and the top alternatives where asked; `finish`:
    None while the row goes on, else "stop" (eos or a stop string) or "length"."""

    choice: int
    token: int
    logprob: float | None = None
    top: TopLogprobs | None = None
    finish: str | None = None


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """log p(prompt[i] | prompt[:i]) for i = 1 .. p-1, and the top alternatives at each."""

    logprobs: list[float]
    top: list[TopLogprobs]


@dataclasses.dataclass(frozen=True)
class Failed:
    """The request could not be served; `message` says why (no traceback)."""

    message: str


@dataclasses.dataclass(frozen=True)
class Cancelled:
    """The batcher stopped before the request finished."""


Event = Token | PromptScores | Failed | Cancelled


@dataclasses.dataclass(eq=False)
class Job:
    """One request: `n` rows continuing `prompt` by up to max_new_tokens tokens.

    seeds: one per row (None: random). logprobs: report the top-k alternatives of each new token (0: the
    drawn token's own only; None: nothing). prompt_logprobs: the same for the prompt's tokens. `emit` is
    called on the batcher's thread with each `Event`; set `cancelled` to free the rows at the next step.
    """

    prompt: list[int]
    max_new_tokens: int
    emit: Callable[[Event], None]
    sampling: Sampling = Sampling()
    seeds: list[int | None] = dataclasses.field(default_factory=lambda: [None])
    eos_id: int | None = None
    stop: StopStrings | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cancelled: bool = False

    @property
    def n(self) -> int:
        return len(self.seeds)


@dataclasses.dataclass(eq=False)
class _Row:
    job: Job
    choice: int
    generator: torch.Generator
    cached: int  # positions in the cache: the prompt and every token drawn but the last
    last: int = 0  # the newest token, fed at the next step
    drawn: list[int] = dataclasses.field(default_factory=list)
    bias: tuple[Tensor, Tensor] | None = None  # its logit_bias on the device (ids, values), made at its first draw


class QueueFull(RuntimeError):
    """More requests wait than the batcher was told to hold."""


class ContinuousBatcher:
    """Decodes the rows of every submitted `Job` in one running batch of at most max_rows rows, on a
    thread of its own (`start`, `stop`); at most max_queue jobs wait for room."""

    def __init__(self, decoder: BatchDecoder, *, max_rows: int = 16, max_queue: int = 64):
        _checks.check_positive_int("max_rows", max_rows)
        _checks.check_non_negative_int("max_queue", max_queue)
        self.decoder, self.max_rows, self.max_queue = decoder, max_rows, max_queue
        self.block_size = decoder.block_size
        self._caches = [RowsKVCache.like(cache, max_rows) for cache in decoder.new_kv_caches(1)]
        self._rows: list[_Row] = []
        self._waiting: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # batched decoding steps taken (what tests and benchmarks read)

    # ------------------------------------------------------------------ the caller's side

    def run(self) -> None:
        """Decode in this thread until `stop` (what a server's main thread does)."""
        with torch.inference_mode():
            while (admitted := self._next_jobs()) is not None:
                for job in admitted:
                    self._guarded(job, self._prefill)
                self._drop_cancelled()
                if self._rows:
                    self._guarded(None, self._step)
        for job in {row.job for row in self._rows} | set(self._waiting):
            job.emit(Cancelled())

    def start(self) -> None:
        """`run` on a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="plainformer-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what waits and what decodes, and end `run` (and its thread, if `start` made one)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFull when max_queue jobs wait already. The job's sizes are checked here."""
        if not job.prompt or job.max_new_tokens < 0 or not 1 <= job.n <= self.max_rows:
            raise ValueError(f"a job needs a prompt, max_new_tokens >= 0 and 1 to {self.max_rows} rows")
        if len(job.prompt) + job.max_new_tokens > self.block_size:
            raise ValueError(f"prompt ({len(job.prompt)} tokens) + max_new_tokens ({job.max_new_tokens}) "
                             f"exceed the context of {self.block_size}")
        with self._wake:
            if self._stopping:
                raise QueueFull("the batcher is stopping")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests wait already (--max-queue {self.max_queue})")
            self._waiting.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Free `job`: its place in the queue at once (the next request may take it), its rows at the
        next step. Nothing more is emitted for it."""
        with self._wake:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)

    @property
    def active_rows(self) -> int:
        return len(self._rows)

    @property
    def queued(self) -> int:
        """Jobs waiting for room."""
        return len(self._waiting)

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ------------------------------------------------------------------ the batcher's thread

    def _next_jobs(self) -> list[Job] | None:
        """The waiting jobs that fit beside the running rows (waiting while there is nothing to do);
        None once stopping."""
        with self._wake:
            while not self._stopping and not self._rows and not self._waiting:
                self._wake.wait()
            if self._stopping:
                return None
            room, admitted = self.max_rows - len(self._rows), []
            while self._waiting and self._waiting[0].n <= room:
                job = self._waiting.popleft()
                if not job.cancelled:
                    admitted.append(job)
                    room -= job.n
            return admitted

    def _guarded(self, job: Job | None, work: Callable[..., None]) -> None:
        """Run work(job) (or work() for a step); an unexpected error fails the job (or every running
        row) with one line to its client, and its traceback goes to stderr, not to a client."""
        try:
            work() if job is None else work(job)
        except Exception as error:  # the batcher must outlive any one request
            traceback.print_exc(file=sys.stderr)
            failed = [job] if job is not None else list({row.job for row in self._rows})
            if job is None:
                self._remove(range(len(self._rows)))
            for each in failed:
                each.emit(Failed(f"decoding failed: {type(error).__name__}: {error}"))

    def _prefill(self, job: Job) -> None:
        """Run the prompt alone, report its scores if asked, draw each row's first token; the rows that
        go on join the batch."""
        caches = self.decoder.new_kv_caches(1)
        ids = torch.tensor([job.prompt], device=self._caches[0].device)
        if job.prompt_logprobs is None:
            last = self.decoder(ids, kv_caches=caches)[0][:, -1]  # (1, V)
        else:
            logits = self.decoder.all_logits(ids, kv_caches=caches)  # (1, p, V)
            chosen, top = _logprobs(logits[0, :-1], ids[0, 1:], job.prompt_logprobs)
            job.emit(PromptScores(chosen, top))
            last = logits[:, -1]
        if job.max_new_tokens == 0:
            return
        rows = [_Row(job, choice, _generator(seed), cached=len(job.prompt)) for choice, seed in enumerate(job.seeds)]
        finished = self._advance(rows, last.expand(len(rows), -1))
        joining = [row for row, done in zip(rows, finished, strict=True) if not done]
        if joining:
            self._join(joining, caches)

    def _join(self, rows: list[_Row], prompt_caches: list[KVCache]) -> None:
        """Give each row a slot, its prompt's keys and values right-aligned with the batch's."""
        length = self._caches[0].length
        prompt_len = prompt_caches[0].length
        for cache in self._caches:
            if not self._rows:
                cache.length = prompt_len
            elif prompt_len > length:
                cache.shift(prompt_len - length)
        for row in rows:
            slot = len(self._rows)
            self._rows.append(row)
            for cache, source in zip(self._caches, prompt_caches, strict=True):
                cache.resize(slot + 1)
                cache.put(slot, source)

    def _step(self) -> None:
        """Every row one token further."""
        if self._caches[0].length + 1 > self.block_size:
            self._compact()
        length = self._caches[0].length
        device = self._caches[0].device
        idx = torch.tensor([[row.last] for row in self._rows], device=device)  # (B, 1)
        starts = [length - row.cached for row in self._rows]
        mask = None
        if any(starts):
            mask = torch.arange(length + 1, device=device)[None, :] >= torch.tensor(starts, device=device)[:, None]
        logits = self.decoder(idx, kv_caches=self._caches, attention_mask=mask)[0][:, -1]  # (B, V)
        for row in self._rows:
            row.cached += 1
        finished = self._advance(self._rows, logits)
        self._remove([i for i, done in enumerate(finished) if done])
        self.steps += 1

    def _advance(self, rows: list[_Row], logits: Tensor) -> list[bool]:
        """Draw each row's next token from its logits (B, V) and report it -> which rows are done. A row
        with no distribution to draw from fails its own job alone: the other requests' rows go on."""
        logits = _biased(rows, logits)
        tokens, undefined = _draw(rows, logits)
        scores = _scores(rows, logits, tokens)
        finished = []
        for row, token, (logprob, top), broken in zip(rows, tokens, scores, undefined, strict=True):
            if broken or row.job.cancelled:
                _fail(row.job, broken)
                finished.append(True)
                continue
            row.last = token
            row.drawn.append(token)
            finish = _finish_reason(row)
            row.job.emit(Token(row.choice, token, logprob, top, finish))
            finished.append(finish is not None)
        return finished

    def _drop_cancelled(self) -> None:
        self._remove([i for i, row in enumerate(self._rows) if row.job.cancelled])

    def _remove(self, slots: range | list[int]) -> None:
        """Free `slots`: the last row moves into each freed slot, highest slot first."""
        for slot in sorted(slots, reverse=True):
            last = len(self._rows) - 1
            if slot != last:
                self._rows[slot] = self._rows[last]
                for cache in self._caches:
                    cache.move(last, slot)
            self._rows.pop()
        for cache in self._caches:
            cache.resize(len(self._rows))
            if not self._rows:
                cache.length = 0

    def _compact(self) -> None:
        """Drop the columns that every row has as padding (the cache is full, and each row fits)."""
        length = self._caches[0].length
        padding = min(length - row.cached for row in self._rows)
        for cache in self._caches:
            cache.shift(-padding)


def _generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)


def _biased(rows: list[_Row], logits: Tensor) -> Tensor:
    """logits (B, V) plus each row's logit_bias, in float32 (`logits` itself when no row has one). Each row's
    bias is copied to the device once, so a step adds it without a host read."""
    biased = [i for i, row in enumerate(rows) if row.job.sampling.logit_bias]
    if not biased:
        return logits
    out = logits.float().clone(memory_format=torch.contiguous_format)  # a prefill's rows are one row expanded
    for i in biased:
        row = rows[i]
        if row.bias is None:
            ids, values = zip(*row.job.sampling.logit_bias, strict=True)
            row.bias = (torch.tensor(ids, device=out.device), torch.tensor(values, dtype=out.dtype, device=out.device))
        out[i].index_add_(0, *row.bias)
    return out


def _draw(rows: list[_Row], logits: Tensor) -> tuple[list[int], list[bool]]:
    """Each row's next token, drawn with its own settings and generator (rows that share settings at once),
    and whether the row had no distribution to draw from (NaN or +inf logits, or only -inf), in one host read."""
    drawn = torch.empty(2, len(rows), dtype=torch.long, device=logits.device)  # (token, undefined) per row
    drawn[1] = 0
    groups: dict[Sampling, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.job.sampling, []).append(i)
    for sampling, members in groups.items():
        tokens, undefined = draw_next(logits[members], temperature=sampling.temperature, top_k=sampling.top_k,
                                      top_p=sampling.top_p, generator=[rows[i].generator for i in members])
        drawn[0, members] = tokens
        if undefined is not None:
            drawn[1, members] = undefined.long()
    tokens_list, undefined_list = drawn.tolist()
    return tokens_list, [bool(flag) for flag in undefined_list]


def _fail(job: Job, broken: bool) -> None:
    """End `job` (its other rows leave at the next step): with one line to its client if a row of it had
    no distribution, silently if it was cancelled."""
    if broken and not job.cancelled:
        job.emit(Failed("decoding failed: the model's logits hold NaN or +inf, or only -inf: there is no "
                        "distribution to sample from"))
    job.cancelled = True


def _scores(rows: list[_Row], logits: Tensor, tokens: list[int]) -> list[tuple[float | None, TopLogprobs | None]]:
    """(log p of the drawn token, top alternatives) for the rows that asked, (None, None) elsewhere."""
    asking = [i for i, row in enumerate(rows) if row.job.logprobs is not None]
    scores: list[tuple[float | None, TopLogprobs | None]] = [(None, None)] * len(rows)
    if asking:
        chosen, top = _logprobs(logits[asking], torch.tensor([tokens[i] for i in asking], device=logits.device),
                                max(rows[i].job.logprobs or 0 for i in asking))
        for i, logprob, alternatives in zip(asking, chosen, top, strict=True):
            scores[i] = (logprob, alternatives[:rows[i].job.logprobs])
    return scores


def _logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[list[float], list[TopLogprobs]]:
    """logits (m, V), tokens (m,) -> log-softmax at each token, and each position's k most likely
    (token, log-probability), in float32 whatever the model's dtype."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (m, V)
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    if k == 0:
        return chosen, [[] for _ in chosen]
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)  # (m, k)
    top = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return chosen, top


def _finish_reason(row: _Row) -> str | None:
    job = row.job
    if job.eos_id is not None and row.last == job.eos_id:
        return "stop"
    if job.stop is not None and job.stop.cut(job.stop.decode(row.drawn)) is not None:
        return "stop"
    if len(row.drawn) >= job.max_new_tokens:
        return "length"
    return None
