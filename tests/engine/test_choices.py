"""`Engine.stream_choices` (OpenAI's `n`): the choices decode together, choice i with the
seed plus i, each exactly what the request of that choice gives alone; leaving early ends
them all."""

from __future__ import annotations

import trio

from lever_actors import Engine, EngineConfig, GenerationOptions
from lever_actors.model.sampling import Sampling
from lever_actors.testing import TINY_ARGS, model_pair

PROMPT = [3, 14, 15, 9]


async def test_each_choice_is_its_request_alone_and_they_come_together():
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2")
    options = GenerationOptions(max_new_tokens=12, sampling=Sampling(temperature=0.8, seed=5))
    done = []
    with trio.fail_after(60):
        async with Engine.open(config) as engine:
            alone = [
                (await engine.generate(PROMPT, options=options.choice(i))).tokens for i in range(3)
            ]
            tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
            parallel = 1
            async for index, event in engine.stream_choices(
                3, PROMPT, options=options, on_done=lambda: done.append(True)
            ):
                tokens[index].append(event.token)
                parallel = max(parallel, event.parallel)
            async for _ in engine.stream_choices(2, PROMPT, options=options):
                break  # leaving early ends both
            after = await engine.generate(PROMPT, options=options)
    assert [tokens[i] for i in range(3)] == alone and alone[0] != alone[1]
    assert parallel > 1  # they shared passes
    assert done == [True]
    assert after.tokens == alone[0]
