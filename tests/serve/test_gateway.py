"""Replicas behind a real gateway (#66, item 5; docs/deploy.md): two tiny `serve` replicas on
127.0.0.1, each with its own prompt-cache directory, behind LiteLLM's router from PyPI
(least-busy). Concurrent requests through it each get the answer a replica gives directly,
and both replicas serve some."""

from __future__ import annotations

import asyncio
import os
from functools import partial

import httpx
import msgspec
import trio

from lever_actors.config import EngineConfig
from lever_actors.serve import serve
from lever_actors.serve.options import ServeOptions
from lever_actors.testing import TINY_ARGS, model_pair

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet
import litellm  # noqa: E402

PROMPTS = [f"t{i} t{i + 3} t{i + 7}" for i in range(1, 9)]
TOKENS = 8


def through_the_router(bases: list[str]) -> list[str]:
    """Blocking: every prompt at once through a LiteLLM router over `bases` (asyncio, in
    this worker thread)."""
    deployment = {"model": "openai/lever", "api_key": "none", "timeout": 30}
    router = litellm.Router(
        model_list=[
            {"model_name": "lever", "litellm_params": deployment | {"api_base": f"{b}/v1"}}
            for b in bases
        ],
        routing_strategy="least-busy",
        num_retries=0,
    )

    async def ask(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        answer = await router.acompletion(
            model="lever", messages=messages, max_tokens=TOKENS, temperature=0
        )
        return answer.choices[0].message.content

    async def all_at_once() -> list[str]:
        return list(await asyncio.gather(*(ask(p) for p in PROMPTS)))

    return asyncio.run(all_at_once())


async def test_two_replicas_behind_litellm_answer_as_each_does_and_both_serve(tmp_path):
    pair = model_pair(TINY_ARGS, "perturbed", 0, tokenizer="words")
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2")
    body = {"max_tokens": TOKENS, "temperature": 0}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            bases = []
            for replica in range(2):
                own = msgspec.structs.replace(config, prompt_cache_dir=str(tmp_path / f"{replica}"))
                bases.append((await nursery.start(partial(serve, own, ServeOptions(port=0))))[0])
            routed = await trio.to_thread.run_sync(through_the_router, bases)
            async with httpx.AsyncClient(timeout=30) as http:
                served = [_finished((await http.get(f"{base}/metrics")).text) for base in bases]
                direct = []
                for prompt in PROMPTS:  # each from replica 0 itself
                    messages = [{"role": "user", "content": prompt}]
                    url = f"{bases[0]}/v1/chat/completions"
                    answer = (await http.post(url, json=body | {"messages": messages})).json()
                    direct.append(answer["choices"][0]["message"]["content"])
            nursery.cancel_scope.cancel()
    assert routed == direct
    assert sum(served) == len(PROMPTS) and all(served), served  # both replicas served


def _finished(metrics: str) -> float:
    """How many requests a replica finished, from its /metrics."""
    counted = "lever_e2e_request_latency_seconds_count"
    [line] = [m for m in metrics.splitlines() if m.startswith(counted)]
    return float(line.split()[-1])
