"""`GET /metrics`: the server's counters in Prometheus's text exposition format (`prometheus_client`, a
registry of the application's own, not the process-wide default one).

    plainformer_requests_total{endpoint, status}        requests answered, by route and HTTP status
    plainformer_prompt_tokens_total                     prompt tokens read: completions, chats, embeddings
    plainformer_completion_tokens_total                 tokens generated
    plainformer_time_to_first_token_seconds             histogram: a request's arrival to its first token
    plainformer_request_duration_seconds{endpoint}      histogram: arrival to the response's last byte
    plainformer_queue_depth, plainformer_active_rows    gauges read from the batcher at each scrape
    plainformer_decoding_steps_total                    the batcher's batched steps

What the batcher knows is read when /metrics is asked (`batcher_metrics`), so the decoding loop counts
nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..generation.batching import ContinuousBatcher

#: The routes counted by name; any other path (a 404) is counted as "other", so labels stay few.
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/tokenize", "/detokenize",
             "/metrics", "/health")
# seconds: from a warm single stream's first token (~0.02 s) to a long queue's (tens of seconds)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def batcher_metrics(batcher: ContinuousBatcher) -> list[Metric]:
    """What the batcher reports at a scrape, one line per metric."""
    return [
        GaugeMetricFamily("plainformer_queue_depth", "jobs (one per prompt) waiting for batch rows", batcher.queued),
        GaugeMetricFamily("plainformer_active_rows", "batch rows decoding now", batcher.active_rows),
        CounterMetricFamily("plainformer_decoding_steps", "batched decoding steps taken", batcher.steps),
        CounterMetricFamily("plainformer_prefix_cache_hits", "prompts that reused a cached prefix's keys and values",
                            batcher.prefix_cache_hits),
        CounterMetricFamily("plainformer_prefix_cache_hit_tokens", "prompt tokens whose keys and values were reused",
                            batcher.prefix_cache_hit_tokens),
    ]


class _BatcherCollector(Collector):
    def __init__(self, batcher: ContinuousBatcher | None):
        self.batcher = batcher

    def collect(self) -> Iterator[Metric]:
        if self.batcher is not None:  # a server that only embeds has no batcher
            yield from batcher_metrics(self.batcher)


class Metrics:
    """The application's counters and histograms; `render` is /metrics's body."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, batcher: ContinuousBatcher | None):
        self.registry = CollectorRegistry()
        self.requests = Counter("plainformer_requests", "HTTP requests answered, by endpoint and status",
                                ("endpoint", "status"), registry=self.registry)
        self.prompt_tokens = Counter("plainformer_prompt_tokens", "prompt tokens read (completions, chats, "
                                     "embeddings)", registry=self.registry)
        self.completion_tokens = Counter("plainformer_completion_tokens", "tokens generated",
                                         registry=self.registry)
        self.ttft = Histogram("plainformer_time_to_first_token_seconds", "from a request's arrival to its first "
                              "generated token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.latency = Histogram("plainformer_request_duration_seconds", "from a request's arrival to its "
                                 "response's last byte", ("endpoint",), buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.registry.register(_BatcherCollector(batcher))

    def answered(self, path: str, status: int, seconds: float) -> None:
        """A response has been sent whole (or its client left): count it under its route."""
        endpoint = path if path in ENDPOINTS else "other"
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def tokens(self, prompt: int, completion: int = 0, ttft: float | None = None) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)
        if ttft is not None:
            self.ttft.observe(ttft)

    def render(self) -> bytes:
        return generate_latest(self.registry)
