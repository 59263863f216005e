"""The engine under asyncio (`lever_actors.engine.aio`): exact output through stream and generate,
gathered requests decoding together, cancellation by break and by task cancel, errors
raised as themselves, requests after the block refused, and requests still running when
it ends failed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from lever_actors.config import EngineConfig
from lever_actors.engine.aio import AsyncEngine
from lever_actors.errors import ConfigError, EngineClosedError
from lever_actors.model.sampling import Sampling
from lever_actors.testing import TINY_ARGS, model_pair, reference_tokens

PROMPT = [3, 1, 4, 1, 5]
NEW = 12
TIMEOUT = 30


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    return EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="gaincost")


def expected(config: EngineConfig, sampling: Sampling | None = None) -> list[int]:
    return reference_tokens(Path(config.target), PROMPT, NEW, sampling=sampling or Sampling())


def run(main):
    async def bounded():
        return await asyncio.wait_for(main(), TIMEOUT)

    return asyncio.run(bounded())


def test_stream_and_generate_are_exact_under_asyncio(config):
    sampling = Sampling(temperature=0.8, top_k=8, seed=21)

    async def main():
        async with AsyncEngine.open(config) as engine:
            streamed = [e.token async for e in engine.stream(PROMPT, max_new_tokens=NEW)]
            sampled = await engine.generate(
                PROMPT, max_new_tokens=NEW, **msgspec.structs.asdict(sampling)
            )
        return streamed, sampled

    streamed, sampled = run(main)
    assert streamed == expected(config)
    assert sampled.tokens == expected(config, sampling)
    assert sampled.finish_reason == "length"


def test_requests_gathered_under_asyncio_decode_together_each_exact(config):
    prompts = [PROMPT, [2, 7, 1, 8], [9, 4]]
    sampling = Sampling(temperature=0.8, seed=5)

    async def main():
        async with AsyncEngine.open(msgspec.structs.replace(config, parallel=3)) as engine:
            return await asyncio.gather(
                *(
                    engine.generate(p, max_new_tokens=NEW, **msgspec.structs.asdict(sampling))
                    for p in prompts
                )
            )

    results = run(main)
    assert max(s.parallel for r in results for s in r.steps) == 3  # really at once
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == reference_tokens(
            Path(config.target), prompt, NEW, sampling=sampling
        )


def test_break_and_task_cancellation_end_the_request_and_the_next_is_exact(config):
    async def main():
        async with AsyncEngine.open(config) as engine:
            async for event in engine.stream(PROMPT, max_new_tokens=NEW):
                if event.generated_tokens == 3:
                    break
            seen = []

            async def consume():
                async for event in engine.stream(PROMPT, max_new_tokens=200):
                    seen.append(event.token)

            task = asyncio.create_task(consume())
            while len(seen) < 2:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            after = await engine.generate(PROMPT, max_new_tokens=NEW)
        return seen, after

    seen, after = run(main)
    assert seen == reference_tokens(Path(config.target), PROMPT, 200)[: len(seen)]
    assert after.tokens == expected(config)


def test_errors_reach_asyncio_as_themselves(config):
    async def main():
        async with AsyncEngine.open(config) as engine:
            with pytest.raises(ConfigError, match="temperature = -1.0: expected >= 0"):
                await engine.generate(PROMPT, temperature=-1.0)
            with pytest.raises(ConfigError, match="temperature = 1e-300: expected 0 \\(greedy\\)"):
                await engine.generate(PROMPT, temperature=1e-300)
            with pytest.raises(ConfigError, match="the prompt is empty"):
                async for _ in engine.stream([]):
                    pass
            ok = await engine.generate(PROMPT, max_new_tokens=NEW)
        with pytest.raises(EngineClosedError, match="this engine was closed"):
            await engine.generate(PROMPT, max_new_tokens=NEW)
        return ok

    assert run(main).tokens == expected(config)


def test_requests_still_running_when_the_block_ends_fail_with_engine_closed(config):
    seen = []

    async def consume(engine):  # slowly: 200 tokens would take seconds
        async for event in engine.stream(PROMPT, max_new_tokens=200):
            seen.append(event)
            await asyncio.sleep(0.01)

    async def main():
        async with AsyncEngine.open(config) as engine:
            streamed = asyncio.create_task(consume(engine))
            while not seen:  # the stream holds the engine; the others wait behind it
                await asyncio.sleep(0.001)
            whole = asyncio.create_task(engine.generate(PROMPT, max_new_tokens=200))
            cancelled = asyncio.create_task(engine.generate(PROMPT, max_new_tokens=200))
            await asyncio.sleep(0.01)
        cancelled.cancel()  # after the trio run has finished: nothing to call into
        return await asyncio.gather(whole, streamed, cancelled, return_exceptions=True)

    whole, streamed, cancelled = run(main)
    for error in (whole, streamed):
        assert isinstance(error, EngineClosedError)
        assert str(error) == "the engine closed before this request finished"
    assert isinstance(cancelled, asyncio.CancelledError)


def test_an_engine_that_cannot_open_raises_its_error(config, tmp_path):
    bad = msgspec.structs.replace(config, target=str(tmp_path / "missing"))

    async def main():
        async with AsyncEngine.open(bad):
            pass

    with pytest.raises(Exception, match="missing") as raised:
        run(main)
    assert not isinstance(raised.value, BaseExceptionGroup)
