"""What a request asks of the batcher and what it hears back: a `Job` (its prompt, rows, sampling and what
to report) and the `Event`s the batcher emits for it (each drawn `Token`, the prompt's `PromptScores`, or
its end as `Failed` or `Cancelled`). The server builds jobs and reads events; `batching.ContinuousBatcher`
runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .. import _checks
from .sampling import check_sampling
from .stopping import StopStrings

#: (token id, its log-probability) pairs, most likely first.
TopLogprobs = list[tuple[int, float]]


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
