"""`lever-actors check-exact`: every speculative policy, and the plain path's greedy (no
torch in its arithmetic; one token a pass, and with copies from the text), against one-token
greedy decoding of the same flash layout, token for token, on real prompts (repetitive prose
among them, where near-ties are common). Any divergence is printed and makes the audit
fail."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.checkpoints.tokenizer import Tokenizer, user_turn
from lever_actors.config import DraftDtype, DramBudget, EngineConfig
from lever_actors.device.layout import torch_dtype
from lever_actors.device.manifest import read_manifest
from lever_actors.draft import DraftModel, load_draft
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError
from lever_actors.model import plain
from lever_actors.model.plain_model import token_stream
from lever_actors.model.sampling import GREEDY
from lever_actors.model.sequential import sequential_cached
from lever_actors.model.transformer import Transformer
from lever_actors.plain_target import PlainTarget
from lever_actors.policy.plain_copies import CopyProposer

PLAIN = "plain"
PLAIN_LOOKUP = "plain-lookup"
PLAIN_POLICIES = (PLAIN, PLAIN_LOOKUP)
# name -> EngineConfig fields; static:8,8 (72 nodes) and gain-cost trees go past every row
# count at which a BLAS kernel may switch
POLICIES: dict[str, dict[str, Any]] = {
    "chain-4": {"tree": "chain:4"},
    "static-4-2-2-1": {"tree": "static:4,2,2,1"},
    "static-8-8": {"tree": "static:8,8"},
    "gaincost": {"tree": "gaincost"},
    "gaincost-ahead": {"tree": "gaincost", "draft_ahead": True},
    "gaincost-prune-always": {"tree": "gaincost", "early_exit": "lens", "prune_when": "always"},
    "gaincost-exit-off": {"tree": "gaincost", "early_exit": "off"},
    "lookup": {"tree": "lookup"},  # copies from the text alone, no draft model
    # trees, a trial of copies from the third step, kept for good (later prompts copy)
    "gaincost-switch": {"tree": "gaincost", "switch_at": 3},
    PLAIN: {},  # no engine: one-token greedy on the plain path (plain_target.py)
    PLAIN_LOOKUP: {},  # the plain path's copies from the text (policy/plain_copies.py)
}

# continued as raw text: repetition makes the target's top two tokens close
REPETITIVE_PROSE = (
    "The rain came down on the roofs of the town, and the rain came down on the fields, and "
    "the rain came down on the river, and the people of the town said to one another that the "
    "rain came down",
    "She walked to the end of the road and back again. She walked to the end of the road and "
    "back again. Each morning she walked to the end of the road and",
    "Once there was a miller who had a mill, and the mill had a wheel, and the wheel had a "
    "spoke, and the spoke had a crack, and the crack had",
    "It was late, and it was cold, and it was dark, and it was quiet; it was late and cold and "
    "dark and quiet in the house where it was always late and",
)


class Prompt(msgspec.Struct, frozen=True):
    name: str  # e.g. "repetitive-0", "prose-1", "humaneval-3"
    tokens: list[int]


class Divergence(msgspec.Struct, frozen=True):
    prompt: str
    policy: str
    position: int  # index of the first generated token that differs
    expected: list[int]  # one-token greedy, from `position` on (a few tokens)
    got: list[int]


def audit_prompts(tokenizer: Tokenizer, texts: dict[str, list[str]], count: int) -> list[Prompt]:
    """`count` prompts taken in turn from the prose continuations and each prompt set (chat
    template applied to the sets' prompts, as `generate` does), while each lasts."""
    # named apart from the prose set's prompts: a name keys its tokens and its reference
    sources = [[(f"repetitive-{i}", t, False) for i, t in enumerate(REPETITIVE_PROSE)]]
    sources += [[(f"{name}-{i}", t, True) for i, t in enumerate(ts)] for name, ts in texts.items()]
    in_turn = [item for row in itertools.zip_longest(*sources) for item in row if item]
    if len(in_turn) < count:
        raise ConfigError(f"only {len(in_turn)} prompts available, {count} asked")
    return [
        Prompt(name, tokenizer.encode(tokenizer.apply_chat_template(user_turn(t)) if chat else t))
        for name, t, chat in in_turn[:count]
    ]


def check_exact(
    layout: Path,
    draft_path: Path,
    prompts: Sequence[Prompt],
    *,
    policies: Sequence[str],
    max_new_tokens: int,
    dram_budget: DramBudget,
    draft_dtype: DraftDtype = "bfloat16",
    parallel: int = 1,
) -> list[Divergence]:
    """Run every policy on every prompt, `parallel` requests at once (all the prompts
    sent together, the engine's batch that many); -> the divergences from one-token greedy."""
    if parallel < 1:
        raise ConfigError(f"parallel = {parallel}: expected >= 1")
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ConfigError(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    checkpoint = load_checkpoint(layout, torch_dtype(read_manifest(layout)))
    stop_ids = checkpoint.tokenizer.eos_ids if checkpoint.tokenizer else frozenset()
    reference = Transformer(checkpoint.args, checkpoint.weights)
    expected = {}
    for prompt in prompts:
        expected[prompt.name] = sequential_cached(
            reference, prompt.tokens, max_new_tokens, stop_ids
        )
        _say(f"one-token greedy {prompt.name}: {len(expected[prompt.name])} tokens")
    del reference, checkpoint
    divergences = []
    for policy in (p for p in policies if p in PLAIN_POLICIES):
        if not plain.available():
            _say(f"{policy}: not run, this CPU cannot run the plain kernels")
            continue
        found = _run_plain(layout, prompts, max_new_tokens, stop_ids, policy == PLAIN_LOOKUP)
        divergences += _compared(policy, prompts, found, expected)
    draft = load_draft(str(draft_path), draft_dtype)
    for policy in (p for p in policies if p not in PLAIN_POLICIES):
        config = EngineConfig(
            target=str(layout),
            draft=str(draft_path),
            dram_budget=dram_budget,
            draft_dtype=draft_dtype,
            parallel=parallel,
            **POLICIES[policy],
        )
        found = trio.run(_run_policy, config, draft, prompts, max_new_tokens, parallel > 1)
        divergences += _compared(policy, prompts, found, expected)
    return divergences


def _compared(
    policy: str,
    prompts: Sequence[Prompt],
    found: dict[str, list[int]],
    expected: dict[str, list[int]],
) -> list[Divergence]:
    """Where `policy`'s tokens part from one-token greedy's, prompt by prompt."""
    divergences = []
    for prompt in prompts:
        got, want = found[prompt.name], expected[prompt.name]
        if got != want:
            common = min(len(got), len(want))
            at = next((i for i in range(common) if got[i] != want[i]), common)
            divergences.append(
                Divergence(prompt.name, policy, at, want[at : at + 5], got[at : at + 5])
            )
    _say(f"{policy}: {len(divergences)} divergences")
    return divergences


def _run_plain(
    layout: Path,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    copies: bool,
) -> dict[str, list[int]]:
    """Each prompt's greedy decoding on the plain path (with copies from the text, or one
    token a pass), one after another."""
    target = PlainTarget(layout)
    model, tokens = target.model, {}
    try:
        for prompt in prompts:
            started = time.perf_counter()
            proposer = CopyProposer() if copies else None
            stream = token_stream(model, prompt.tokens, max_new_tokens, stop_ids, GREEDY, proposer)
            got = tokens[prompt.name] = list(stream)
            seconds = time.perf_counter() - started
            _say(f"  plain {prompt.name}: {len(got)} tokens, {seconds:.1f} s")
    finally:
        target.close()
    return tokens


async def _run_policy(
    config: EngineConfig,
    draft: DraftModel,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    together: bool,
) -> dict[str, list[int]]:
    """Each prompt's tokens: the prompts one after another, or all sent at once."""
    tokens = {}

    async def run(engine: Engine, prompt: Prompt) -> None:
        started = time.perf_counter()
        result = await engine.generate(prompt.tokens, max_new_tokens=max_new_tokens)
        tokens[prompt.name] = result.tokens
        largest = max(s.tree_nodes for s in result.steps)
        shared = max(s.parallel for s in result.steps)
        _say(
            f"  {config.tree} {prompt.name}: {len(result.tokens)} tokens in "
            f"{len(result.steps)} steps, largest tree {largest} nodes, passes shared by up "
            f"to {shared} requests, {time.perf_counter() - started:.1f} s"
        )

    async with Engine.open(config, draft=draft) as engine:
        if together:
            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(run, engine, prompt)
        else:
            for prompt in prompts:
                await run(engine, prompt)
    return tokens


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
