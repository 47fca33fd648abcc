"""`GET /metrics` of a running server, read by `prometheus_client`'s own parser: each counter moves by what
known requests read and drew, requests are counted by endpoint and status, the histograms count each
request once, and the batcher's gauges are there."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import API_KEY

MODEL = "run"


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    response = httpx.get(f"{server.root}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def test_counters_move_by_the_tokens_and_requests_of_known_requests(server, client):
    server.wait_idle()
    before = scrape(server)
    client.completions.create(model=MODEL, prompt=["To be", "Whether"], max_tokens=5, n=2, temperature=0)
    stream = client.completions.create(model=MODEL, prompt="To", max_tokens=7, temperature=0, stream=True)
    assert sum(1 for _ in stream)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "To be"}], max_tokens=3,
                                   temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="To", max_tokens=1, logit_bias={"1000000": 1})
    httpx.post(f"{server.root}/tokenize", json={"content": "To"}, headers={"Authorization": f"Bearer {API_KEY}"},
               timeout=10)
    after = scrape(server)
    completions = {"endpoint": "/v1/completions"}
    assert moved(before, after, "plainformer_requests_total", status="200", **completions) == 2
    assert moved(before, after, "plainformer_requests_total", status="400", **completions) == 1
    assert moved(before, after, "plainformer_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert moved(before, after, "plainformer_requests_total", endpoint="/tokenize", status="200") == 1
    assert moved(before, after, "plainformer_request_duration_seconds_count", **completions) == 3
    # 2 prompts x 2 choices x 5 tokens + 7 streamed + 3 chat tokens
    assert moved(before, after, "plainformer_completion_tokens_total") == 20 + 7 + 3
    assert moved(before, after, "plainformer_time_to_first_token_seconds_count") == 3
    assert moved(before, after, "plainformer_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert moved(before, after, "plainformer_decoding_steps_total") > 0
    assert after[("plainformer_active_rows", ())] == 0 and after[("plainformer_queue_depth", ())] == 0


def test_prompt_tokens_count_what_each_request_read(server, client):
    before = scrape(server)
    client.completions.create(model=MODEL, prompt=["To be", "Whether"], max_tokens=1, n=3)
    client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=0)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Whether"}],
                                            max_tokens=1)
    after = scrape(server)
    assert moved(before, after, "plainformer_prompt_tokens_total") == 5 + 7 + 3 + answer.usage.prompt_tokens


def test_prefix_cache_hits_count_the_prompts_and_tokens_that_reused_a_cached_prefix(server, client):
    prompt = "that is the question, to suffer"  # no earlier test's prompt begins with "t"
    response = httpx.post(f"{server.root}/tokenize", json={"content": prompt}, timeout=10,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    before = scrape(server)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    first = scrape(server)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    second = scrape(server)
    assert moved(before, first, "plainformer_prefix_cache_hits_total") == 0
    assert moved(first, second, "plainformer_prefix_cache_hits_total") == 1
    # all of the prompt but its last token, whose logits draw the first token
    assert moved(first, second, "plainformer_prefix_cache_hit_tokens_total") == len(tokens) - 1
