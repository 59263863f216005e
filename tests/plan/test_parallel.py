"""How many requests decode at once: `parallel` as given, else as many chat turns as the KV
room left after loading holds."""

from __future__ import annotations

from lever_actors.config import EngineConfig
from lever_actors.plan.context import TEMPORARY_BYTES, Context
from lever_actors.plan.parallel import MAX_AUTO_PARALLEL, parallel_of


def test_parallel_is_the_config_s_or_what_the_kv_room_holds():
    def context(free_bytes: int) -> Context:
        return Context(512, 32768, 1024, 2**30, free_bytes, asked=False)

    assert parallel_of(EngineConfig(target="t", parallel=3), context(0)) == 3
    auto = EngineConfig(target="t")
    assert parallel_of(auto, context(0)) == 1
    # three quarters of what a step's temporaries leave: 3,072 tokens
    assert parallel_of(auto, context(TEMPORARY_BYTES + 4 * 1024 * 1024)) == 3
    assert parallel_of(auto, context(2**34)) == MAX_AUTO_PARALLEL
