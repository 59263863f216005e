"""`GET /metrics`: what a gateway routes on and an operator watches, in Prometheus's text
format (prometheus_client, a registry of the server's own).

The load gauges are named as vLLM's with our prefix, so that a gateway's mapping is one
line: `lever_num_requests_waiting` (vLLM: `vllm:num_requests_waiting`),
`lever_num_requests_running` (`vllm:num_requests_running`) and `lever_kv_cache_usage_perc`
(`vllm:kv_cache_usage_perc`; ours is the share of the KV room the placed requests may
fill, 0 to 1). A finished request (whole, or streamed to its end) counts its tokens and
times; the flash bytes and the plan are read when scraped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lever_actors.channels.messages import TokenEvent
from lever_actors.engine.engine import Engine
from lever_actors.engine.results import GenerationResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5)
STEP_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8)


class Finished(msgspec.Struct, frozen=True):
    """What the metrics take of a request that ran to its end."""

    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    first_token_seconds: float  # from its start
    last_token_seconds: float
    steps: int

    @classmethod
    def of_result(cls, result: GenerationResult) -> Finished:
        last = result.prefill_seconds + result.decode_seconds
        return cls(
            result.prompt_tokens,
            result.cached_tokens,
            result.generated_tokens,
            result.prefill_seconds,
            last,
            len(result.steps),
        )

    @classmethod
    def of_events(cls, first: TokenEvent, last: TokenEvent) -> Finished:
        return cls(
            last.prompt_tokens,
            last.cached_tokens,
            last.generated_tokens,
            first.elapsed_seconds,
            last.elapsed_seconds,
            last.step + 1,
        )


class ServerMetrics:
    """The server's figures, and the text of a scrape."""

    def __init__(self, engine: Engine) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        batch = engine.batch
        waiting = Gauge(
            "lever_num_requests_waiting",
            "Requests waiting for a place in the batch",
            registry=registry,
        )
        waiting.set_function(lambda: batch.queued)
        running = Gauge(
            "lever_num_requests_running", "Requests decoding in the batch", registry=registry
        )
        running.set_function(lambda: batch.active)
        usage = Gauge(
            "lever_kv_cache_usage_perc",
            "Share of the KV room the placed requests may fill (0 to 1)",
            registry=registry,
        )
        usage.set_function(lambda: batch.kv_usage)
        self.prompt = Counter(
            "lever_prompt_tokens", "Prompt tokens of finished requests", registry=registry
        )
        self.cached = Counter(
            "lever_prompt_tokens_cached",
            "Prompt tokens whose KV the prefix cache held",
            registry=registry,
        )
        self.generated = Counter(
            "lever_generation_tokens", "Generated tokens of finished requests", registry=registry
        )
        self.first_token = Histogram(
            "lever_time_to_first_token_seconds",
            "Request start to its first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.gap = Histogram(
            "lever_inter_token_latency_seconds",
            "A request's mean time between tokens after its first",
            buckets=GAP_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "lever_e2e_request_latency_seconds",
            "Request start to its last token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.per_step = Histogram(
            "lever_tokens_per_step",
            "A request's mean tokens per target pass",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.generated_tokens = 0
        registry.register(_EngineFigures(engine, lambda: self.generated_tokens))

    def finished(self, request: Finished) -> None:
        self.prompt.inc(request.prompt_tokens)
        self.cached.inc(request.cached_tokens)
        self.generated.inc(request.generated_tokens)
        self.generated_tokens += request.generated_tokens
        self.first_token.observe(request.first_token_seconds)
        self.latency.observe(request.last_token_seconds)
        if request.generated_tokens > 1:
            gaps = request.generated_tokens - 1
            self.gap.observe((request.last_token_seconds - request.first_token_seconds) / gaps)
        if request.steps:
            self.per_step.observe(request.generated_tokens / request.steps)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineFigures(Collector):
    """Read when scraped: the bytes read from flash (in all, and per generated token) and
    the decode plan in use."""

    def __init__(self, engine: Engine, generated: Callable[[], int]) -> None:
        self.engine, self.generated = engine, generated

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        read = self.engine.target.store.stats.bytes_read
        yield CounterMetricFamily("lever_flash_bytes_read", "Bytes read from flash", value=read)
        tokens = self.generated()
        per_token = GaugeMetricFamily(
            "lever_flash_bytes_per_token", "Flash bytes read per generated token, since start"
        )
        per_token.add_metric([], read / tokens if tokens else 0.0)
        yield per_token
        plan = GaugeMetricFamily("lever_decode_plan", "The decode plan in use", labels=["plan"])
        plan.add_metric(
            ["copies" if self.engine.switch.copying else self.engine.plan.decode.name], 1
        )
        yield plan
