"""One start-up plan: made in plan/ alone as the engine loads, the process read once at each
moment a part of it is made, kept whole on `Engine.plan` and printed as one block."""

from __future__ import annotations

import ast
from pathlib import Path

import lever_actors
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.plan import memory as memory_module
from lever_actors.testing import TINY_ARGS, model_pair

# what makes a part of the start-up plan
PLANNERS = {
    "memory_plan",
    "plan_memory",
    "plan_context",
    "parallel_of",
    "choose_plan",
    "check_room",
    "read_process",
    "plan_residency",
}
# the cost model's probe opens a target to time it, under a residency of its own
MEASURING = {Path("policy/figures.py")}


async def test_the_plan_is_whole_and_printed_as_one_block():
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), plan="auto")
    async with Engine.open(config) as engine:
        plan = engine.plan
        assert plan.residency.budget == plan.memory.budget  # the target's, under the plan
        assert plan.memory.context_tokens <= plan.context.tokens  # room kept for them
        assert 1 <= plan.parallel
        assert plan.decode.auto and plan.decode.name in plan.decode.predicted
        memory_line, plan_line = str(plan).splitlines()
        assert memory_line.startswith("memory: limit ") and memory_line.endswith("(auto)")
        assert plan_line.startswith(f"plan: {plan.decode.name} (auto; predicted tok/s: ")


async def test_the_process_is_read_once_at_each_moment_a_part_is_planned(monkeypatch):
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), plan="auto")
    readings = []
    limit = memory_module.memory_limit_bytes  # read once a reading
    monkeypatch.setattr(memory_module, "memory_limit_bytes", lambda: readings.append(1) or limit())
    async with Engine.open(config):
        pass
    # before the tokenizer; the least plan; the candidates; the chosen one's room; after
    # the draft; after the policies
    assert len(readings) == 6


def test_plans_are_made_in_plan_alone():
    package = Path(lever_actors.__file__).parent
    callers = set()
    for path in package.rglob("*.py"):
        if path.relative_to(package) in MEASURING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                if name in PLANNERS:
                    callers.add(path.relative_to(package).parts[0])
    assert callers == {"plan"}
