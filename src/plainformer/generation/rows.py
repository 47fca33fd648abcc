"""One row of the running batch: the choice of a job it decodes, its generator and cache length, and the
per-token work done for every row at once: adding each row's logit_bias, drawing each row's next token with
its own settings, the log-probabilities it reports, and why it finishes."""

from __future__ import annotations

import dataclasses
import secrets

import torch
from torch import Tensor

from .jobs import Failed, Job, Sampling, TopLogprobs
from .sampling import draw_next


@dataclasses.dataclass(eq=False)
class Row:
    job: Job
    choice: int
    generator: torch.Generator
    cached: int  # positions in the cache: the prompt and every token drawn but the last
    last: int = 0  # the newest token, fed at the next step
    drawn: list[int] = dataclasses.field(default_factory=list)
    bias: tuple[Tensor, Tensor] | None = None  # its logit_bias on the device (ids, values), made at its first draw


def new_generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)


def biased(rows: list[Row], logits: Tensor) -> Tensor:
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


def draw(rows: list[Row], logits: Tensor) -> tuple[list[int], list[bool]]:
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


def fail(job: Job, broken: bool) -> None:
    """End `job` (its other rows leave at the next step): with one line to its client if a row of it had
    no distribution, silently if it was cancelled."""
    if broken and not job.cancelled:
        job.emit(Failed("decoding failed: the model's logits hold NaN or +inf, or only -inf: there is no "
                        "distribution to sample from"))
    job.cancelled = True


def scores(rows: list[Row], logits: Tensor, tokens: list[int]) -> list[tuple[float | None, TopLogprobs | None]]:
    """(log p of the drawn token, top alternatives) for the rows that asked, (None, None) elsewhere."""
    asking = [i for i, row in enumerate(rows) if row.job.logprobs is not None]
    scores: list[tuple[float | None, TopLogprobs | None]] = [(None, None)] * len(rows)
    if asking:
        chosen, top = logprobs(logits[asking], torch.tensor([tokens[i] for i in asking], device=logits.device),
                                max(rows[i].job.logprobs or 0 for i in asking))
        for i, logprob, alternatives in zip(asking, chosen, top, strict=True):
            scores[i] = (logprob, alternatives[:rows[i].job.logprobs])
    return scores


def logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[list[float], list[TopLogprobs]]:
    """logits (m, V), tokens (m,) -> log-softmax at each token, and each position's k most likely
    (token, log-probability), in float32 whatever the model's dtype."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (m, V)
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    if k == 0:
        return chosen, [[] for _ in chosen]
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)  # (m, k)
    top = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return chosen, top


def finish_reason(row: Row) -> str | None:
    job = row.job
    if job.eos_id is not None and row.last == job.eos_id:
        return "stop"
    if job.stop is not None and job.stop.cut(job.stop.decode(row.drawn)) is not None:
        return "stop"
    if len(row.drawn) >= job.max_new_tokens:
        return "length"
    return None
