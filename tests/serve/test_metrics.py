"""`GET /metrics` (#66, item 3): Prometheus's text format, which its own parser reads; the
load gauges a gateway routes on move while requests run, and the counters and histograms
count the requests that ended, whole or streamed."""

from __future__ import annotations

from functools import partial

import httpx
import msgspec
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from lever_actors.config import EngineConfig
from lever_actors.serve import serve
from lever_actors.serve.options import ServeOptions
from lever_actors.testing import TINY_ARGS, model_pair

TOKENS = 40


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    pair = model_pair(TINY_ARGS, "perturbed", 0, tokenizer="words")
    # steps of 50 ms: two requests run for a second or more
    return EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2", parallel=2)


def samples(text: str) -> dict[str, float]:
    """Each sample's value by its name (and labels, where it has any)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            found[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return found


async def test_metrics_parse_and_move_while_requests_run(config):
    slow = msgspec.structs.replace(config, jitter_seconds=0.05)
    body = {"prompt": "t1 t2", "max_tokens": TOKENS, "temperature": 0}
    seen_running = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            base = (await nursery.start(partial(serve, slow, ServeOptions(port=0))))[0]
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                idle = samples((await http.get("/metrics")).text)
                async with trio.open_nursery() as asking:
                    asking.start_soon(partial(http.post, "/v1/completions", json=body))
                    streamed = body | {"stream": True}
                    asking.start_soon(partial(http.post, "/v1/completions", json=streamed))
                    while not seen_running or seen_running[-1] < 2:
                        running = samples((await http.get("/metrics")).text)
                        seen_running.append(running["lever_num_requests_running"])
                        await trio.sleep(0.02)
                after = await http.get("/metrics")
            nursery.cancel_scope.cancel()
    assert after.headers["content-type"].startswith("text/plain; version=0.0.4")
    done = samples(after.text)
    assert idle["lever_num_requests_running"] == idle["lever_num_requests_waiting"] == 0
    assert idle["lever_kv_cache_usage_perc"] == 0
    assert 0 < running["lever_kv_cache_usage_perc"] <= 1  # two requests placed
    assert done["lever_num_requests_running"] == done["lever_kv_cache_usage_perc"] == 0
    assert done["lever_generation_tokens_total"] == 2 * TOKENS
    assert done["lever_prompt_tokens_total"] == 2 * 2
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert done[f"lever_{histogram}_seconds_count"] == 2
    assert done["lever_tokens_per_step_count"] == 2
    assert done["lever_decode_plan{plan=trees}"] == 1
    assert done["lever_flash_bytes_read_total"] >= 0
