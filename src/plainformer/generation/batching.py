"""Continuous batching: requests join a decoding batch while it runs and leave it when done (Orca, Yu et
al. 2022), each row drawing exactly the tokens it would draw alone.

One thread owns the model (`run`, or `start` for a thread of its own). Each turn it admits the requests
that wait (when no prefill is under way), runs one chunk of their prefill, then advances every row by one
token:

    prefill    the k waiting prompts (within prefill_tokens, padding included) run together, left-padded
               to the longest, P columns (k, P): an attention mask hides the padding and each row counts
               its positions from its own first
               token (`nn.masks.padded_positions_and_mask`), so each last position's logits are those the
               prompt gets alone, and each first token is drawn from them. The columns run in chunks of
               at most prefill_chunk // k, one chunk a turn, so that the decoding rows take a step between
               chunks of a long prompt. Its keys and values are then copied into the batch's cache (every
               one of a job's `n` rows starts from them). With a prefix cache (`prefix_cache`), the
               leading positions that a prompt shares with one prefilled before are copied in, not run:
               the last S columns run, S the longest prompt's part that no entry holds, the columns before
               come from the cache (a row's reused prefix right-aligned before them, so no row has a gap).
               Prompts that reuse long prefixes beside one that reuses none go first, the rest in the next
               prefill, when that at least halves the columns run (rows x columns);
    step       the rows' newest tokens (B, 1) run as one batch over the shared cache (`RowsKVCache`):
               rows are right-aligned, row b holding columns L - n_b .. L - 1, and the attention mask
               (B, L + 1) hides the columns before them, so each row attends its own tokens and counts its
               positions from its own first token;
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
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from .. import _checks
from ..nn.kv_cache import RowsKVCache
from . import rows as per_row
from .jobs import Cancelled, Failed, Job, PromptScores, Token, TopLogprobs
from .prefix_cache import Prefix, PrefixCache
from .rows import Row


class BatchDecoder(Protocol):
    """What the batcher drives: `decoders.GPTDecoder`."""

    block_size: int

    def new_kv_caches(self, batch_size: int) -> list[Any]: ...

    def __call__(self, idx: Tensor, *, kv_caches: list[Any] | None = None,
                 attention_mask: Tensor | None = None) -> tuple[Tensor, Any]: ...

    def all_logits(self, idx: Tensor, *, kv_caches: list[Any] | None = None,
                   attention_mask: Tensor | None = None) -> Tensor: ...


@dataclasses.dataclass(eq=False)
class _Prefill:
    """Jobs whose prompts are prefilled together: ids (k, P) left-padded, real (k, P) True at a prompt's
    token (None when no row is padded), their own cache of k rows and P columns, the columns run or reused
    so far, and the prompt scores gathered so far of the jobs that asked."""

    jobs: list[Job]
    ids: Tensor
    real: Tensor | None
    caches: list[RowsKVCache]
    done: int
    scores: list[tuple[list[float], list[TopLogprobs]] | None]


#: The prompt tokens (padding included) the server admits to one prefill: the prompts past them wait for the
#: next, so that the first of many waiting prompts get their first tokens after one pass, not after all of
#: them (docs/performance.md, "Serving under load").
PREFILL_TOKENS = 128


class QueueFull(RuntimeError):
    """More requests wait than the batcher was told to hold."""


class ContinuousBatcher:
    """Decodes the rows of every submitted `Job` in one running batch of at most max_rows rows, on a
    thread of its own (`start`, `stop`); at most max_queue jobs wait for room. A prefill forward pass runs
    at most prefill_chunk tokens, padding included (a chunk of one column at least); with prefill_tokens, the
    prompts that wait join one prefill while their tokens, padding included, stay within it (one at least).
    prefix_cache_bytes > 0 keeps prompts' keys and values for the prompts that begin as they do
    (`prefix_cache`; none for a model with a sliding window, whose cache keeps only the window's positions)."""

    def __init__(self, decoder: BatchDecoder, *, max_rows: int = 16, max_queue: int = 64,
                 prefill_chunk: int = 512, prefill_tokens: int | None = None,
                 prefix_cache_bytes: int = 0):
        _checks.check_positive_int("max_rows", max_rows)
        _checks.check_non_negative_int("max_queue", max_queue)
        _checks.check_positive_int("prefill_chunk", prefill_chunk)
        if prefill_tokens is not None:
            _checks.check_positive_int("prefill_tokens", prefill_tokens)
        _checks.check_non_negative_int("prefix_cache_bytes", prefix_cache_bytes)
        self.decoder, self.max_rows, self.max_queue = decoder, max_rows, max_queue
        self.block_size, self.prefill_chunk, self.prefill_tokens = decoder.block_size, prefill_chunk, prefill_tokens
        self._caches = [RowsKVCache.like(cache, max_rows) for cache in decoder.new_kv_caches(1)]
        windowed = self._caches[0].window is not None
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes and not windowed else None
        self._hits = self._hit_tokens = 0
        self._prefill: _Prefill | None = None
        self._rows: list[Row] = []
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
                if admitted:
                    self._guarded(admitted, lambda: self._begin_prefill(admitted))
                if self._prefill is not None:
                    self._guarded(self._prefill.jobs, self._prefill_chunk)
                self._drop_cancelled()
                if self._rows:
                    self._guarded(None, self._step)
        prefilling = [] if self._prefill is None else self._prefill.jobs
        for job in {row.job for row in self._rows} | set(self._waiting) | set(prefilling):
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

    @property
    def prefix_cache_hits(self) -> int:
        """Jobs whose prompt reused cached keys and values."""
        return self._hits

    @property
    def prefix_cache_hit_tokens(self) -> int:
        """Prompt positions reused from the prefix cache, not computed."""
        return self._hit_tokens

    # ------------------------------------------------------------------ the batcher's thread

    def _next_jobs(self) -> list[Job] | None:
        """The waiting jobs that fit beside the running rows, none while a prefill is under way (waiting
        while there is nothing to do); None once stopping."""
        with self._wake:
            while not self._stopping and not self._rows and not self._waiting and self._prefill is None:
                self._wake.wait()
            if self._stopping:
                return None
            if self._prefill is not None:
                return []
            admitted: list[Job] = []
            room, longest = self.max_rows - len(self._rows), 0
            while self._waiting and self._waiting[0].n <= room:
                job = self._waiting[0]
                wider = max(longest, len(job.prompt))
                # the prompts past prefill_tokens wait for the next prefill: the first ones' tokens come sooner
                if admitted and self.prefill_tokens is not None and (len(admitted) + 1) * wider > self.prefill_tokens:
                    break
                self._waiting.popleft()
                if not job.cancelled:
                    admitted.append(job)
                    room, longest = room - job.n, wider
            return admitted

    def _guarded(self, jobs: list[Job] | None, work: Callable[[], None]) -> None:
        """Run work (for `jobs`, or for every running row when None); an unexpected error fails those jobs
        (a prefill's are dropped, a step's rows removed) with one line to each client, and its traceback goes
        to stderr, not to a client."""
        try:
            work()
        except Exception as error:  # the batcher must outlive any one request
            traceback.print_exc(file=sys.stderr)
            if jobs is None:
                failed = list({row.job for row in self._rows})
                self._remove(range(len(self._rows)))
            else:
                failed, self._prefill = jobs, None
            for each in failed:
                each.emit(Failed(f"decoding failed: {type(error).__name__}: {error}"))

    def _begin_prefill(self, jobs: list[Job]) -> None:
        """Lay the prompts out left-padded in a cache of their own, with the prefix each reuses already in
        it; `_prefill_chunk` runs the rest."""
        matches = [None if self.prefix_cache is None else self.prefix_cache.match(job.prompt, job.prompt_logprobs)
                   for job in jobs]
        runs = [len(job.prompt) - (0 if match is None else match[1]) for job, match in zip(jobs, matches,
                                                                                            strict=True)]
        kept = _worth_running_first(runs)
        if len(kept) < len(jobs):  # the others wait for the next prefill, at the head of the queue
            with self._wake:
                self._waiting.extendleft(reversed([job for r, job in enumerate(jobs) if r not in kept]))
            jobs[:] = [jobs[r] for r in kept]  # in place: should this prefill fail, those jobs are `_guarded`'s
            matches, runs = [matches[r] for r in kept], [runs[r] for r in kept]
        lengths = [len(job.prompt) for job in jobs]
        suffix = max(runs)  # the columns to run: the most that any prompt has beyond its reusable prefix
        width, device = max(lengths), self._caches[0].device
        start = width - suffix
        ids = torch.zeros(len(jobs), width, dtype=torch.long)
        for r, job in enumerate(jobs):
            ids[r, width - lengths[r]:] = torch.tensor(job.prompt)
        real = None
        if min(lengths) < width:
            real = (torch.arange(width)[None, :] >= torch.tensor([width - n for n in lengths])[:, None]).to(device)
        caches = [RowsKVCache.like(cache, len(jobs), width) for cache in self._caches]
        for cache in caches:
            cache.resize(len(jobs))
            cache.length = start
        scores: list[tuple[list[float], list[TopLogprobs]] | None] = []
        for r, (job, match) in enumerate(zip(jobs, matches, strict=True)):
            reused = max(0, lengths[r] - suffix)  # at most the match's: suffix >= lengths[r] - match
            if reused:
                assert match is not None
                for layer, cache in enumerate(caches):
                    cache.write(r, width - lengths[r], match[0].keys[layer][:, :reused],
                                match[0].values[layer][:, :reused])
                self._hits += 1
                self._hit_tokens += reused
            if job.prompt_logprobs is not None:
                scores.append(match[0].scores(reused, job.prompt_logprobs) if reused and match else ([], []))
            else:
                scores.append(None)
        ids = ids.to(device)
        if start:
            caches[0].set_last_tokens(ids[:, start - 1])  # the predecessor of the first column to run
        self._prefill = _Prefill(jobs, ids, real, caches, start, scores)

    def _prefill_chunk(self) -> None:
        """Run the next columns of the prefill under way; after its last, report the prompts' scores where
        asked, draw each row's first token, and the rows that go on join the batch."""
        group = self._prefill
        assert group is not None
        if all(job.cancelled for job in group.jobs):
            self._prefill = None
            return
        k, width = group.ids.shape
        begin, end = group.done, min(width, group.done + max(1, self.prefill_chunk // k))
        chunk, mask = group.ids[:, begin:end], None if group.real is None else group.real[:, :end]
        asking = [r for r, scores in enumerate(group.scores) if scores is not None]
        if asking:
            logits = self.decoder.all_logits(chunk, kv_caches=group.caches, attention_mask=mask)  # (k, n, V)
            self._score(group, asking, logits, begin, end)
            last = logits[:, -1]
        else:
            last = self.decoder(chunk, kv_caches=group.caches, attention_mask=mask)[0][:, -1]  # (k, V)
        group.done = end
        if end == width:
            self._prefill = None
            self._finish_prefill(group, last)

    def _score(self, group: _Prefill, asking: list[int], logits: Tensor, begin: int, end: int) -> None:
        """Add the scores of the prompt tokens that columns begin .. end-1's logits (k, end - begin, V)
        predict to the asking rows' (column c predicts the token at c + 1)."""
        width = group.ids.shape[1]
        for r in asking:
            job, scores = group.jobs[r], group.scores[r]
            assert scores is not None and job.prompt_logprobs is not None
            low, high = max(begin, width - len(job.prompt)), min(end, width - 1)
            if low < high:
                chosen, top = per_row.logprobs(logits[r, low - begin:high - begin], group.ids[r, low + 1:high + 1],
                                               job.prompt_logprobs)
                scores[0].extend(chosen)
                scores[1].extend(top)

    def _finish_prefill(self, group: _Prefill, last: Tensor) -> None:
        """last (k, V): each prompt's last logits. Report scores, keep the prompts in the prefix cache, draw
        the first tokens and join the rows that go on."""
        width = group.ids.shape[1]
        for job, scores in zip(group.jobs, group.scores, strict=True):
            if scores is not None and not job.cancelled:
                job.emit(PromptScores(*scores))
        if self.prefix_cache is not None:
            for r, (job, scores) in enumerate(zip(group.jobs, group.scores, strict=True)):
                self._keep(job, group, r, width - len(job.prompt), scores)
        rows: list[Row] = []
        sources: list[int] = []
        for r, job in enumerate(group.jobs):
            if job.max_new_tokens > 0:
                for choice, seed in enumerate(job.seeds):
                    rows.append(Row(job, choice, per_row.new_generator(seed), cached=len(job.prompt)))
                    sources.append(r)
        if not rows:
            return
        finished = self._advance(rows, last[sources])
        joining = [(row, r) for row, r, done in zip(rows, sources, finished, strict=True) if not done]
        self._join(joining, group.caches)

    def _keep(self, job: Job, group: _Prefill, r: int, first: int,
              scores: tuple[list[float], list[TopLogprobs]] | None) -> None:
        """Put row r's prompt (columns first .. P-1) in the prefix cache, unless an entry holds it."""
        assert self.prefix_cache is not None
        if self.prefix_cache.holds(job.prompt, job.prompt_logprobs):
            return
        n = len(job.prompt)
        pairs = [cache.read(r, first, n) for cache in group.caches]
        entry = Prefix(job.prompt, [k for k, _ in pairs], [v for _, v in pairs])
        if scores is not None:
            entry.logprobs = torch.tensor(scores[0], dtype=torch.float64)
            entry.top_ids = torch.tensor([[t for t, _ in top] for top in scores[1]], dtype=torch.long).view(n - 1, -1)
            entry.top_logprobs = torch.tensor([[p for _, p in top] for top in scores[1]],
                                              dtype=torch.float64).view(n - 1, -1)
        self.prefix_cache.add(entry)

    def _join(self, rows: list[tuple[Row, int]], prompt_caches: list[RowsKVCache]) -> None:
        """Give each row a slot, and its prompt's keys and values (row r of `prompt_caches`) right-aligned
        with the batch's."""
        for row, r in rows:
            length = self._caches[0].length
            for cache in self._caches:
                if not self._rows:
                    cache.length = row.cached
                elif row.cached > length:
                    cache.shift(row.cached - length)
            slot = len(self._rows)
            self._rows.append(row)
            for cache, source in zip(self._caches, prompt_caches, strict=True):
                cache.resize(slot + 1)
                cache.put(slot, source, r, min(row.cached, source.held))

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

    def _advance(self, rows: list[Row], logits: Tensor) -> list[bool]:
        """Draw each row's next token from its logits (B, V) and report it -> which rows are done. A row
        with no distribution to draw from fails its own job alone: the other requests' rows go on."""
        logits = per_row.biased(rows, logits)
        tokens, undefined = per_row.draw(rows, logits)
        scores = per_row.scores(rows, logits, tokens)
        finished = []
        for row, token, (logprob, top), broken in zip(rows, tokens, scores, undefined, strict=True):
            if broken or row.job.cancelled:
                per_row.fail(row.job, broken)
                finished.append(True)
                continue
            row.last = token
            row.drawn.append(token)
            finish = per_row.finish_reason(row)
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


def _worth_running_first(runs: list[int]) -> list[int]:
    """Which of the prompts to prefill together, given the columns each must run (beyond what it reuses):
    all, unless the ones that run fewest, prefilled first and the rest after, cost at most half the
    columns (rows x columns) of one pass over all, every row running the longest's columns (a few prompts
    that reuse a long prefix beside one that reuses none)."""
    order = sorted(range(len(runs)), key=runs.__getitem__)
    longest = runs[order[-1]]
    split = min(range(1, len(runs)), key=lambda i: i * runs[order[i - 1]] + (len(runs) - i) * longest,
                default=len(runs))
    if split == len(runs) or 2 * (split * runs[order[split - 1]] + (len(runs) - split) * longest) > len(runs) * longest:
        return list(range(len(runs)))
    return sorted(order[:split])
