"""Testing support, for our tests and for users': tiny random checkpoints, hypothesis
strategies over engine configurations, and `assert_matches_sequential`, the exactness check.

The engine must emit exactly what sequential decoding of the target emits ("Exactness
contract" in DESIGN.md), in the target's own dtype: greedy, or sampled with the same seed
(`samplings`; `EngineCase.sampling`). The tiny models are float64,
where near-ties cannot flip an argmax; `bf16_engine_cases` draws bf16 targets just large
enough for rounding to depend on how many rows a pass has, with near-tied twin tokens
(`bf16_args`, `TWIN_GAP`), where a pass that rounds a token otherwise than one-token
decoding changes the output. A typical property test:

    from hypothesis import given
    from lever_actors.testing import assert_matches_sequential, engine_cases

    @given(case=engine_cases())
    async def test_exact(case):
        await assert_matches_sequential(case.engine_config(), case.prompt, case.max_new_tokens)

Building and converting a checkpoint costs more than decoding a few tokens with it, so
checkpoints and flash layouts are cached per process (a small LRU in a temporary
directory, removed at exit): examples that draw the same model reuse its files.

The strategies need hypothesis (`pip install 'lever-actors[dev]'`); the checkpoints and the
oracle do not, so they import without it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from lever_actors.testing.checkpoints import (
    BYTE_VOCAB,
    DRAFT_RELATIONS,
    TINY_ARGS,
    TWIN_GAP,
    ModelPair,
    bf16_args,
    budget_bytes,
    flash_layout,
    hf_config,
    model_pair,
    perturbed_checkpoint,
    random_hf_tensors,
    tiny_checkpoint,
    with_exit_predictor,
    write_byte_tokenizer,
    write_perturbed_copy,
    write_tiny_checkpoint,
    write_tiny_tokenizer,
)
from lever_actors.testing.oracle import assert_matches_sequential, reference_tokens

if TYPE_CHECKING:
    from lever_actors.testing.strategies import (
        EngineCase,
        bf16_engine_cases,
        bf16_model_args,
        budgets,
        channel_sizes,
        draft_relations,
        early_exits,
        engine_cases,
        grammars,
        jitters,
        large_trees,
        model_args,
        prompts,
        prune_thresholds,
        repetitive_prompts,
        ring_slots,
        samplings,
        seeds,
        trees,
    )

__all__ = [
    "BYTE_VOCAB",
    "DRAFT_RELATIONS",
    "TINY_ARGS",
    "EngineCase",
    "ModelPair",
    "TWIN_GAP",
    "assert_matches_sequential",
    "bf16_args",
    "bf16_engine_cases",
    "bf16_model_args",
    "budget_bytes",
    "budgets",
    "channel_sizes",
    "draft_relations",
    "early_exits",
    "engine_cases",
    "flash_layout",
    "grammars",
    "hf_config",
    "jitters",
    "large_trees",
    "model_args",
    "model_pair",
    "perturbed_checkpoint",
    "prompts",
    "prune_thresholds",
    "random_hf_tensors",
    "reference_tokens",
    "repetitive_prompts",
    "ring_slots",
    "samplings",
    "seeds",
    "tiny_checkpoint",
    "trees",
    "with_exit_predictor",
    "write_byte_tokenizer",
    "write_perturbed_copy",
    "write_tiny_checkpoint",
    "write_tiny_tokenizer",
]

# what __all__ names and the imports above leave unbound: the strategies, imported on first
# use so that only they need hypothesis
_STRATEGIES = frozenset(__all__) - globals().keys()


def __getattr__(name: str) -> object:
    if name in _STRATEGIES:
        return getattr(import_module("lever_actors.testing.strategies"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _STRATEGIES)
