"""llama.cpp itself, through xllamacpp (llama.cpp's server and runtime as a prebuilt CPU wheel): how it
tokenizes a text, its greedy tokens and its log-probabilities, for a GGUF file.

The server runs in this process; its HTTP endpoint on 127.0.0.1 answers /tokenize, which the Python API
does not wrap. Greedy decoding is temperature 0; log-probabilities are llama.cpp's softmax of the raw
logits (`n_probs`), before any sampler.
"""

from __future__ import annotations

import contextlib
import json
import math
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import xllamacpp


class LlamaCpp:
    def __init__(self, path: Path, n_ctx: int):
        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.n_ctx = n_ctx
        params.n_parallel = 1
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 1
        params.warmup = False
        self.server = xllamacpp.Server(params)

    def tokenize(self, text: str) -> list[int]:
        request = urllib.request.Request(
            self.server.listening_address + "/tokenize", headers={"Content-Type": "application/json"},
            data=json.dumps({"content": text, "add_special": False}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["tokens"]

    def _complete(self, ids: Sequence[int], max_tokens: int, n_probs: int) -> list[dict]:
        result = self.server.handle_completions({"prompt": list(ids), "max_tokens": max_tokens, "temperature": 0.0,
                                                 "n_probs": n_probs, "cache_prompt": True})
        return result["choices"][0]["logprobs"]["content"]

    def greedy(self, ids: Sequence[int], n: int) -> list[int]:
        """Up to n greedy tokens after `ids` (fewer when llama.cpp stops at the end-of-text token)."""
        return [step["id"] for step in self._complete(ids, n, 1)]

    def mean_log_likelihood(self, ids: Sequence[int], vocab_size: int) -> float:
        """(1/(n-1)) Σ_i log p(ids[i] | ids[:i]), one request per position, the whole distribution asked for."""
        total = 0.0
        for i in range(1, len(ids)):
            (step,) = self._complete(ids[:i], 1, vocab_size)
            total += next(t["logprob"] for t in step["top_logprobs"] if t["id"] == ids[i])
        return total / (len(ids) - 1)


@contextlib.contextmanager
def llama_cpp(path: Path, n_ctx: int) -> Iterator[LlamaCpp]:
    runtime = LlamaCpp(path, n_ctx)
    try:
        yield runtime
    finally:
        del runtime.server  # stops its threads and frees the model


def mean_log_likelihood(logits, ids: Sequence[int]) -> float:
    """Ours: logits (n, V) of ids -> (1/(n-1)) Σ_i log softmax(logits[i-1])[ids[i]], in float64."""
    import torch

    log_p = torch.log_softmax(logits.double(), dim=-1)
    picked = log_p[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    value = picked.mean().item()
    assert math.isfinite(value)
    return value
