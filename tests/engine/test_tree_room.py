"""A request's KV holds its prompt and answer, not a tree beyond the answer's end
(engine/state.py kv_tokens): its trees shrink to the tokens it has yet to emit, a carried
tree trimmed to them (tests/actors/test_drafter.py), and its tokens stay the target's."""

from __future__ import annotations

from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.engine.results import GenerationResult
from lever_actors.testing import reference_tokens
from lever_actors.testing.checkpoints import TINY_ARGS, model_pair


def assert_trees_fit(prompt: list[int], result: GenerationResult, n: int) -> None:
    """Each step's draft nodes (its tree less the chain: the prompt, then the bonus token)
    at most the tokens still to come."""
    emitted = 0
    for step in result.steps:
        chain = len(prompt) if step.step == 0 else 1
        assert step.tree_nodes - chain <= n - emitted, result.steps
        emitted += step.new_tokens


async def test_a_requests_trees_fit_in_what_its_answer_leaves():
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="static:4,3")
    async with Engine.open(config) as engine:
        for k in range(4):
            prompt = [(5 * i + k) % TINY_ARGS.vocab_size for i in range(9)]
            result = await engine.generate(prompt, max_new_tokens=7)
            assert result.tokens == reference_tokens(config.target, prompt, 7)
            assert_trees_fit(prompt, result, 7)
