"""The model behind the API: requests become jobs of the one `ContinuousBatcher`, and its events fill
each request's choices; embeddings come from the model's `Embedder` (a BERT's, or a GPT's given a pooling),
and /tokenize and /detokenize from its tokenizer.

Each prompt of a request is one job of `n` rows. Row j of prompt i draws with seed + i·n + j when a
seed is given: the row `plainformer sample --seed SEED --num-samples n` draws for that prompt, and the
same row alone draws the same tokens. A job's prompt plus max_tokens must fit the model's context, and
its prompt's forward pass the memory available (`families.memory_estimates`); else a 400 names the field. So must
the response: its tokens, counting each echoed prompt token and each logprob alternative as one, at
most max_response_tokens (what bounds the time and memory its JSON takes).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .. import _checks
from ..data.tokenizers import Tokenizer
from ..families.memory_estimates import forward_bytes
from ..generation.batching import PREFILL_TOKENS, ContinuousBatcher, QueueFull
from ..generation.jobs import Cancelled, Event, Failed, Job, PromptScores, Sampling, Token
from ..generation.sampling import derived_seed
from ..generation.stopping import StopStrings
from ..memory import MemoryBudgetError, check_memory
from ..models.gpt import GPT
from .choices import Choice
from .embeddings import Embedder, shortened
from .protocol import SHUTTING_DOWN, APIError, Decoding, EmbeddingRequest, TokenizeRequest

RETRY_AFTER_S = 1
MAX_RESPONSE_TOKENS = 1 << 18  # ~10 MB of JSON with logprobs


class Service:
    """`model` (with its tokenizer) served as `name` by a batcher of max_batch rows and max_queue waiting
    jobs (one per prompt) and a prefix cache of prefix_cache_bytes (0: none), each response carrying at most
    max_response_tokens (see the module docstring); `embedder` answers /v1/embeddings. A server of an embedding
    model alone (model None) generates nothing: its completion endpoints answer 400 naming `model`."""

    def __init__(self, model: GPT | None, name: str, *, embedder: Embedder | None = None, max_batch: int = 16,
                 max_queue: int = 64, max_response_tokens: int = MAX_RESPONSE_TOKENS, prefix_cache_bytes: int = 0):
        tokenizer = model.tokenizer if model is not None else None if embedder is None else embedder.tokenizer
        if model is None and embedder is None:
            raise ValueError("a service needs a model that generates or one that embeds")
        if tokenizer is None:
            raise ValueError("the model has no tokenizer, so text cannot be encoded")
        _checks.check_positive_int("max_response_tokens", max_response_tokens)
        self.model, self.embedder, self.tokenizer, self.name = model, embedder, tokenizer, name
        self.batcher = None if model is None else ContinuousBatcher(
            model.decoder(), max_rows=max_batch, max_queue=max_queue, prefill_tokens=PREFILL_TOKENS,
            prefix_cache_bytes=prefix_cache_bytes)
        self.max_response_tokens = max_response_tokens
        self.created = int(time.time())

    def generator(self) -> ContinuousBatcher:
        """The batcher, or a 400 naming `model` for a model that only embeds."""
        if self.batcher is None:
            raise APIError(f"the model {self.name!r} embeds text and does not generate it: use /v1/embeddings",
                           param="model")
        return self.batcher

    @property
    def gpt(self) -> GPT:
        """The model that generates (its callers come after `generator`)."""
        assert self.model is not None, "a service that only embeds has no GPT"
        return self.model

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size if self.model is None else self.model.config.vocab_size

    @property
    def block_size(self) -> int:
        """The longest input: the GPT's context, or the embedding model's max_len."""
        if self.model is None:
            assert self.embedder is not None
            return self.embedder.max_len
        return self.model.config.block_size

    def model_card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "plainformer",
                "max_model_len": self.block_size}

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(f"The model {name!r} does not exist: this server serves {self.name!r}", param="model",
                           status=404, code="model_not_found")

    def encode(self, prompt: str | list[int], param: str) -> list[int]:
        """A prompt's token ids: a text encoded, or ids checked against the vocabulary."""
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except ValueError as error:  # a character the vocabulary lacks
                raise APIError(f"{param}: {error}", param=param) from None
        else:
            ids = prompt
            self.check_ids(ids, param)
        if not ids:
            raise APIError(f"{param} encodes to no tokens; give at least one", param=param)
        return ids

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"{param} holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})",
                           param=param)

    def check_logit_bias(self, decoding: Decoding) -> None:
        """A 400 naming logit_bias when it names a token id outside the vocabulary."""
        bad = [token for token, _ in decoding.logit_bias if token >= self.vocab_size]
        if bad:
            raise APIError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})",
                           param="logit_bias")

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        """llama.cpp's /tokenize answer: {"tokens": [id, ...]}, or [{"id", "piece"}, ...] with_pieces."""
        try:
            ids = (self.tokenizer.encode if request.add_special else self.tokenizer.encode_text)(request.content)
        except ValueError as error:  # a character the vocabulary lacks
            raise APIError(f"content: {error}", param="content") from None
        if not request.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": i, "piece": self.tokenizer.decode([i]) or self.tokenizer.id_to_token(i) or ""}
                           for i in ids]}

    def detokenize(self, tokens: list[int]) -> dict[str, Any]:
        """llama.cpp's /detokenize answer: {"content": text}."""
        self.check_ids(tokens, "tokens")
        return {"content": self.tokenizer.decode(tokens)}

    def embeddings(self, request: EmbeddingRequest) -> tuple[Any, int]:
        """The request's embeddings (N, d) float32 as a numpy array, in its order, and the tokens they read;
        a 400 naming `model` when this model does not embed, `input` for an input it cannot take."""
        if self.embedder is None:
            raise APIError(f"the model {self.name!r} does not embed: serve a BERT or MiniLM, or start the server "
                           "with --pooling mean|last to embed with this GPT's hidden states", param="model")
        embedder = self.embedder
        ids = []
        for i, item in enumerate(request.inputs):
            param = "input" if len(request.inputs) == 1 else f"input[{i}]"
            if isinstance(item, str):
                try:
                    x = embedder.tokenize(item)
                except ValueError as error:  # a character the vocabulary lacks
                    raise APIError(f"{param}: {error}", param="input") from None
            else:
                x = item
                self.check_ids(x, "input")
            if not x:
                raise APIError(f"{param} encodes to no tokens; give at least one", param="input")
            if len(x) > embedder.max_len and not (embedder.truncates and isinstance(item, str)):
                raise APIError(f"{param} is {len(x)} tokens, more than the {embedder.max_len} this model embeds",
                               param="input", code="context_length_exceeded")
            ids.append(x)
        vectors = embedder.embed(ids)
        if request.dimensions is not None:
            if request.dimensions > vectors.shape[1]:
                raise APIError(f"dimensions must be at most {vectors.shape[1]}, this model's, got "
                               f"{request.dimensions}", param="dimensions")
            vectors = shortened(vectors, request.dimensions)
        return vectors.cpu().numpy(), sum(map(len, ids))

    def max_new_tokens(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """The tokens a prompt may gain: max_tokens if it fits the context with the prompt (None: all that
        fit); and the prompt's forward pass must fit the memory."""
        if len(ids) > self.block_size:
            raise APIError(f"{param} is {len(ids)} tokens, more than the model's context of {self.block_size}",
                           param=param, code="context_length_exceeded")
        room = self.block_size - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise APIError(f"max_tokens={max_tokens} and the prompt's {len(ids)} tokens exceed the model's context "
                           f"of {self.block_size} tokens: at most {room}", param="max_tokens",
                           code="context_length_exceeded")
        model = self.gpt
        dtype = model.token_embedding.weight.dtype
        try:
            check_memory(f"a prompt of {len(ids)} tokens needs ~{{needed}} for its forward pass",
                         lambda: forward_bytes(model.config, 1, len(ids), dtype=dtype))
        except MemoryBudgetError as error:
            raise APIError(str(error), param=param) from None
        return room if max_tokens is None else max_tokens

    def check_response_size(self, prompts: Sequence[list[int]], max_new: Sequence[int], n: int, *, echo: bool,
                            logprobs: int | None, logprobs_param: str) -> None:
        """A 400 when the response could carry more than max_response_tokens: Σ_prompts (echoed prompt + new
        tokens) · n · (1 + logprobs alternatives). It names the first field the request raised of n, prompt
        (more than one), logprobs, prompt (echoed), max_tokens."""
        per_token = 1 if logprobs is None else 1 + logprobs
        tokens = sum((len(ids) if echo else 0) + new for ids, new in zip(prompts, max_new, strict=True)) * n * per_token
        if tokens <= self.max_response_tokens:
            return
        param = ("n" if n > 1 else "prompt" if len(prompts) > 1 else logprobs_param if per_token > 1 else
                 "prompt" if echo else "max_tokens")
        alternatives = f" x {per_token} with the logprob alternatives" if per_token > 1 else ""
        raise APIError(f"the response could carry {tokens} tokens, more than the {self.max_response_tokens} this "
                       f"server answers (--max-response-tokens): {len(prompts)} prompt(s) x n={n}, each choice's "
                       f"{'echoed prompt and ' if echo else ''}new tokens{alternatives}; lower {param}", param=param)


class Exchange:
    """One request in the batcher: its jobs, and the choices their events fill (`updates`), which `loop`
    (the server's event loop; default: the running one) receives, so that it may be made on another thread."""

    def __init__(self, service: Service, prompts: Sequence[list[int]], decoding: Decoding, *,
                 loop: asyncio.AbstractEventLoop | None = None, logprobs: int | None = None, echo: bool = False,
                 params: Sequence[str] = (), logprobs_param: str = "logprobs"):
        self.service, self.decoding = service, decoding
        self.batcher = service.generator()
        service.check_logit_bias(decoding)
        self.first_token_at: float | None = None  # time.perf_counter() when its first token came (for /metrics)
        tokenizer: Tokenizer = service.tokenizer
        self.stop = StopStrings(tokenizer.decode, decoding.stop) if decoding.stop else None
        n = decoding.n
        self.choices = [Choice(i * n + j, ids, echo=echo) for i, ids in enumerate(prompts) for j in range(n)]
        sampling = Sampling(temperature=float(decoding.temperature), top_k=None if decoding.top_k == -1 else
                            decoding.top_k, top_p=None if decoding.top_p in (None, 1) else float(decoding.top_p),
                            logit_bias=decoding.logit_bias)
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        loop = loop or asyncio.get_running_loop()
        max_new = [service.max_new_tokens(ids, decoding.max_tokens, params[i] if params else "prompt")
                   for i, ids in enumerate(prompts)]
        service.check_response_size(prompts, max_new, n, echo=echo, logprobs=logprobs, logprobs_param=logprobs_param)
        self.jobs, self._open = [], 0
        self._scored_only: set[int] = set()  # prompts whose job scores the prompt and draws nothing
        for i, ids in enumerate(prompts):
            seed = decoding.seed
            job = Job(ids, max_new[i], self._emitter(loop, i), sampling=sampling,
                      seeds=[None if seed is None else derived_seed(seed, i * n + j) for j in range(n)],
                      eos_id=tokenizer.eos_id, stop=self.stop, logprobs=logprobs,
                      prompt_logprobs=logprobs if echo and logprobs is not None else None)
            if max_new[i] or job.prompt_logprobs is not None:
                self.jobs.append(job)
                self._open += n if max_new[i] else 1
            if not max_new[i]:
                if job.prompt_logprobs is not None:
                    self._scored_only.add(i)
                for choice in self.choices[i * n:(i + 1) * n]:
                    choice.finish = "length"

    def _emitter(self, loop: asyncio.AbstractEventLoop, prompt: int) -> Any:
        def emit(event: Event) -> None:  # on the batcher's thread
            with contextlib.suppress(RuntimeError):  # the loop has closed: the request is gone with it
                loop.call_soon_threadsafe(self._queue.put_nowait, (prompt, event))
        return emit

    def submit(self) -> None:
        """Every job into the batcher, or none (a 429 with Retry-After when its queue is full, a 503 once
        the server stops)."""
        batcher = self.batcher
        for submitted, job in enumerate(self.jobs):
            try:
                batcher.submit(job)
            except QueueFull as error:
                self.cancel(self.jobs[:submitted])
                if batcher.stopping:
                    raise APIError(SHUTTING_DOWN, status=503, type="server_error") from None
                raise APIError(f"the server is busy: {error}; retry shortly", status=429,
                               type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def cancel(self, jobs: Sequence[Job] | None = None) -> None:
        """Free the queue places of `jobs` (default all) at once, and their rows at the batcher's next step."""
        for job in self.jobs if jobs is None else jobs:
            if not job.cancelled:
                self.batcher.cancel(job)

    async def updates(self) -> AsyncIterator[Choice]:
        """Each choice as an event changes it, until every choice has finished."""
        n = self.decoding.n
        while self._open:
            prompt, event = await self._queue.get()
            if isinstance(event, Failed):
                raise APIError(event.message, status=500, type="server_error")
            if isinstance(event, Cancelled):
                raise APIError(SHUTTING_DOWN, status=503, type="server_error")
            if isinstance(event, PromptScores):
                for choice in self.choices[prompt * n:(prompt + 1) * n]:
                    choice.prompt_scores = event
                self._open -= prompt in self._scored_only
                for choice in self.choices[prompt * n:(prompt + 1) * n]:
                    yield choice
                continue
            assert isinstance(event, Token)
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            choice = self.choices[prompt * n + event.choice]
            choice.tokens.append(event.token)
            choice.logprobs.append(event.logprob)
            choice.top.append(event.top)
            if event.finish is not None:
                choice.finish = event.finish
                self._open -= 1
            yield choice

    def settled(self, choice: Choice) -> bool:
        """Whether `choice` was whole before any job ran (max_tokens 0, no prompt to score)."""
        return choice.finish is not None and choice.index // self.decoding.n not in self._scored_only

    def usage(self) -> dict[str, int]:
        prompt_tokens = sum(len(choice.prompt) for choice in self.choices[::self.decoding.n])
        completion_tokens = sum(len(choice.tokens) for choice in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}
