"""The exactness oracle: sequential decoding of the target in its layout's own dtype, greedy
or sampled with a seed, and `assert_matches_sequential`, which holds the engine to it and
reports where they part."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import msgspec

from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import EngineConfig
from lever_actors.device.layout import torch_dtype
from lever_actors.device.manifest import read_manifest
from lever_actors.draft import DraftModel
from lever_actors.engine import Engine
from lever_actors.engine.results import GenerationResult
from lever_actors.model.grammar import Grammar
from lever_actors.model.matcher import Matcher
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.model.sequential import sequential_reference
from lever_actors.model.transformer import Transformer
from lever_actors.options import GenerationOptions

_references: OrderedDict[Path, tuple[Transformer, Tokenizer | None]] = OrderedDict()


def _reference_model(layout: Path) -> tuple[Transformer, Tokenizer | None]:
    """The target loaded whole in the dtype its layout stores (the engine computes in it),
    and its tokenizer, cached per layout."""
    layout = Path(layout)
    if layout not in _references:
        checkpoint = load_checkpoint(layout, torch_dtype(read_manifest(layout)))
        model = Transformer(checkpoint.args, checkpoint.weights)
        _references[layout] = (model, checkpoint.tokenizer)
        while len(_references) > 16:
            _references.popitem(last=False)
    _references.move_to_end(layout)
    return _references[layout]


def reference_tokens(
    layout: Path,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop: Sequence[str] = (),
    sampling: Sampling = GREEDY,
    grammar: Grammar | None = None,
) -> list[int]:
    """Sequential decoding (greedy, or sampled with `sampling`; under `grammar`'s masks if
    given) of the target layout with no KV cache, in the layout's own dtype (float64 or
    bf16), which the engine computes in too. Like the engine it stops after one of its
    tokenizer's end tokens, or after the first token whose text completes one of the `stop`
    strings."""
    model, tokenizer = _reference_model(layout)
    stop_ids = tokenizer.eos_ids if tokenizer else frozenset()
    matcher = None
    if grammar is not None:
        if tokenizer is None:
            raise ValueError(f"{layout}: a grammar needs a target with a tokenizer")
        vocab = model.args.vocab_size
        matcher = Matcher(grammar, tokenizer.grammar_vocabulary(vocab), vocab)
    tokens = sequential_reference(model, list(prompt), max_new_tokens, stop_ids, sampling, matcher)
    if stop:
        if tokenizer is None:
            raise ValueError(f"{layout}: stop strings need a target with a tokenizer")
        for end in range(1, len(tokens) + 1):
            if any(s in tokenizer.decode(tokens[:end]) for s in stop):
                return tokens[:end]
    return tokens


async def assert_matches_sequential(
    engine_config: EngineConfig,
    prompt: Sequence[int],
    n: int,
    *,
    stop: Sequence[str] = (),
    draft: DraftModel | None = None,
    sampling: Sampling = GREEDY,
    grammar: Grammar | None = None,
) -> GenerationResult:
    """Run the engine on `prompt` for `n` new tokens (with `stop` strings, `draft` if given,
    `sampling`: greedy, or its temperature, filters and seed, and `grammar`) and assert that its
    tokens are exactly `reference_tokens` of its target with the same sampling, with a
    message naming the first position that differs. Returns the engine's result.

    The reference computes in the target layout's dtype, as the engine does: in float64
    (tiny models from this module) or in bf16, where the engine must round every token as
    one-token decoding does. The draft's dtype cannot change the output, only the
    acceptance rate.
    """
    expected = reference_tokens(Path(engine_config.target), prompt, n, stop, sampling, grammar)
    async with Engine.open(engine_config, draft=draft) as engine:
        options = GenerationOptions(max_new_tokens=n, stop=stop, sampling=sampling, grammar=grammar)
        result = await engine.generate(list(prompt), options=options)
    got = list(result.tokens)
    if got != expected:
        raise AssertionError(
            _mismatch(engine_config, list(prompt), n, stop, sampling, grammar, expected, result)
        )
    return result


def _mismatch(
    config: EngineConfig,
    prompt: list[int],
    n: int,
    stop: Sequence[str],
    sampling: Sampling,
    grammar: Grammar | None,
    expected: list[int],
    result: GenerationResult,
) -> str:
    got = list(result.tokens)
    first = next(
        (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
        min(len(expected), len(got)),
    )
    step, emitted = 0, 0
    for stats in result.steps:  # which step emitted the first wrong token
        if emitted + stats.new_tokens > first:
            break
        emitted += stats.new_tokens
        step += 1
    return "\n".join(
        [
            f"engine output differs from sequential {_decoding(sampling)} of the target at new "
            f"token {first} (step {step}); {len(got)} tokens vs {len(expected)} expected",
            f"  prompt:   {prompt}  (max_new_tokens={n}, stop={list(stop)}, {sampling})",
            f"  grammar:  {grammar}",
            f"  agreed:   {expected[:first]}",
            f"  expected: ...{expected[first:]}",
            f"  engine:   ...{got[first:]}",
            f"  new tokens per step: {[s.new_tokens for s in result.steps]}",
            f"  tree nodes per step: {[s.tree_nodes for s in result.steps]}",
            f"  config: {msgspec.json.encode(config).decode()}",
        ]
    )


def _decoding(sampling: Sampling) -> str:
    return "greedy decoding" if sampling.greedy else f"sampling (seed {sampling.seed})"
