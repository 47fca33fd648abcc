"""llama.cpp itself, through xllamacpp (llama.cpp's server and runtime as a prebuilt CPU wheel): how it
tokenizes a text, its greedy tokens and its log-probabilities, for a GGUF file.

The server runs in a child process and is asked over HTTP on 127.0.0.1 (/tokenize, /v1/completions), so that
llama.cpp's threads never share a process with a test's torch, and a llama.cpp that stops answering ends in a
TimeoutError naming it rather than in a test run that never ends. Greedy decoding is temperature 0;
log-probabilities are llama.cpp's softmax of the raw logits (`n_probs`), before any sampler.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

SECONDS = 60  # for the server to load a test's model, and for each answer (a test's models are tiny)

# The child: llama.cpp's server for argv[1] with a context of argv[2], its address on stdout, then it serves
# until its parent closes its stdin (or kills it).
_SERVE = """
import sys
import xllamacpp

params = xllamacpp.CommonParams()
params.model.path = sys.argv[1]
params.n_ctx = int(sys.argv[2])
params.n_parallel = 1
params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 1
params.warmup = False
server = xllamacpp.Server(params)
print(server.listening_address, flush=True)
sys.stdin.read()
"""


class LlamaCpp:
    def __init__(self, path: Path, n_ctx: int):
        self.process = subprocess.Popen([sys.executable, "-c", _SERVE, str(path), str(n_ctx)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.address = self._first_line()

    def _first_line(self) -> str:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(SECONDS):
                raise TimeoutError(f"llama.cpp's server did not start within {SECONDS} s")
        address = self.process.stdout.readline().strip()
        if not address:
            raise RuntimeError(f"llama.cpp's server exited with {self.process.wait(SECONDS)} before it started")
        return address

    def close(self) -> None:
        self.process.kill()
        self.process.wait(SECONDS)

    def _post(self, endpoint: str, body: dict) -> dict:
        request = urllib.request.Request(self.address + endpoint, headers={"Content-Type": "application/json"},
                                         data=json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=SECONDS) as response:
            return json.loads(response.read())

    def tokenize(self, text: str) -> list[int]:
        return self._post("/tokenize", {"content": text, "add_special": False})["tokens"]

    def _complete(self, ids: Sequence[int], max_tokens: int, n_probs: int) -> list[dict]:
        result = self._post("/v1/completions", {"prompt": list(ids), "max_tokens": max_tokens, "temperature": 0.0,
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
        runtime.close()


def mean_log_likelihood(logits, ids: Sequence[int]) -> float:
    """Ours: logits (n, V) of ids -> (1/(n-1)) Σ_i log softmax(logits[i-1])[ids[i]], in float64."""
    import torch

    log_p = torch.log_softmax(logits.double(), dim=-1)
    picked = log_p[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    value = picked.mean().item()
    assert math.isfinite(value)
    return value
