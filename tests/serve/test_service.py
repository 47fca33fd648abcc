"""The service in this process, its batcher not started so that jobs wait: a full queue is a 429 with
Retry-After, and a prompt whose forward pass the memory cannot hold is a 400 naming it."""

from __future__ import annotations

import asyncio

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest
import torch

import plainformer as pf
from plainformer.data.tokenizers import CharTokenizer
from plainformer.memory import memory_limit
from plainformer.serve.app import create_app
from plainformer.serve.protocol import APIError
from plainformer.serve.service import Service


@pytest.fixture
def service() -> Service:
    torch.manual_seed(0)
    tokenizer = CharTokenizer("abcdefgh ")
    model = pf.GPT(pf.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layers=1, n_heads=2, d_model=16,
                                d_ff=32)).eval()
    model.tokenizer = tokenizer
    return Service(model, "tiny", max_batch=2, max_queue=1)


def test_a_full_queue_is_a_429_with_retry_after(service):
    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(service))  # no lifespan: the batcher never starts
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": "tiny", "prompt": "abc", "max_tokens": 4}
            waiting = asyncio.create_task(client.post("/v1/completions", json=body))
            while not service.batcher._waiting:  # the first request holds the one place in the queue
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/completions", json=body)
            waiting.cancel()
            return refused

    refused = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_prompt_the_memory_cannot_hold_is_a_400_naming_it(service):
    with memory_limit(1000), pytest.raises(APIError, match="a prompt of 20 tokens needs") as raised:
        service.max_new_tokens([1] * 20, 4, "prompt[2]")
    assert raised.value.param == "prompt[2]" and raised.value.status == 400
