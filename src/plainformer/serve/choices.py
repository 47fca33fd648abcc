"""One choice of a response as it fills, token by token, and its OpenAI JSON: the text (cut before a
stop string), its delta for a stream, and its log-probabilities in the legacy shape (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) or the chat shape (`content`: token, logprob, bytes,
top_logprobs).

Log-probabilities are log-softmax(z) of the model's raw logits z (before temperature, top-k or top-p);
with `echo`, the prompt's come first, its first token's being null (nothing precedes it). A token's
text is its own decoding; `text_offset` counts characters from the start of the choice's text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..data.tokenizers import Tokenizer
from ..generation.jobs import PromptScores, TopLogprobs
from ..generation.stopping import StopStrings

REPLACEMENT = "\ufffd"  # what a byte-level token that ends mid-character decodes to, until the next arrives


@dataclasses.dataclass(eq=False)
class Choice:
    index: int
    prompt: list[int]
    echo: bool = False
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float | None] = dataclasses.field(default_factory=list)
    top: list[TopLogprobs | None] = dataclasses.field(default_factory=list)
    prompt_scores: PromptScores | None = None
    finish: str | None = None
    sent: str = ""  # the text a stream has sent so far

    def text(self, tokenizer: Tokenizer, stop: StopStrings | None, *, final: bool = True) -> str:
        """The new tokens' text, cut before the first stop string; not `final` (a stream's), also less
        what could still begin one or complete a character."""
        text = tokenizer.decode(self.tokens)
        cut = None if stop is None else stop.cut(text)
        if cut is not None:
            return text[:cut]
        if final:
            return text
        held = stop.held_back(text) if stop is not None else 0
        return text[:len(text) - held].rstrip(REPLACEMENT)

    def delta(self, tokenizer: Tokenizer, stop: StopStrings | None) -> str:
        """The text not sent yet (all of it once the choice has finished); marks it sent."""
        shown = self.text(tokenizer, stop, final=self.finish is not None)
        if not shown.startswith(self.sent):  # a decoding that took back what it said: wait for more
            return ""
        new, self.sent = shown[len(self.sent):], shown
        return new

    def scored_ids(self) -> list[int]:
        return (self.prompt if self.echo else []) + self.tokens

    def scores(self) -> tuple[list[float | None], list[TopLogprobs | None]]:
        """Log-probability and alternatives of each of `scored_ids` (None for an echoed first token)."""
        if not self.echo:
            return self.logprobs, self.top
        assert self.prompt_scores is not None  # an echo with logprobs asks the batcher for them
        return ([None, *self.prompt_scores.logprobs, *self.logprobs],
                [None, *self.prompt_scores.top, *self.top])


def token_text(tokenizer: Tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def legacy_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs: list[float | None],
                    top: list[TopLogprobs | None], offset: int = 0) -> dict[str, Any]:
    """The legacy endpoint's logprobs object for tokens `ids`, the first at character `offset`."""
    texts = [token_text(tokenizer, token) for token in ids]
    offsets = []
    for i in range(len(ids)):
        offsets.append(offset + len(tokenizer.decode(ids[:i])))
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": [None if alternatives is None else
                         {token_text(tokenizer, t): lp for t, lp in alternatives} for alternatives in top],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs: list[float | None],
                  top: list[TopLogprobs | None]) -> dict[str, Any]:
    """The chat endpoint's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in alternatives or []]}
                        for token, logprob, alternatives in zip(ids, logprobs, top, strict=True)]}
