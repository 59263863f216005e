"""check-exact's audit on the tiny pair: every policy against one-token greedy, one request
at a time or all at once in the engine's batch; a divergence is found where there is one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lever_actors.bench import exactness
from lever_actors.bench.exactness import Prompt, check_exact
from lever_actors.config import DramBudget
from lever_actors.errors import ConfigError
from lever_actors.model import plain
from lever_actors.testing.checkpoints import TINY_ARGS, bf16_args, model_pair

PROMPTS = [Prompt("a", [5, 6, 7, 8]), Prompt("b", [1, 2, 3]), Prompt("c", [9, 9, 4, 2, 7])]


@pytest.fixture(scope="module")
def pair():
    return model_pair(TINY_ARGS, "perturbed", 0)


def audit(pair, **options):
    return check_exact(
        Path(pair.target),
        Path(pair.draft),
        PROMPTS,
        policies=["chain-4", "gaincost", "lookup"],
        max_new_tokens=12,
        dram_budget=DramBudget("all"),
        draft_dtype="float64",
        **options,
    )


@pytest.mark.parametrize("parallel", [1, 3])
def test_every_policy_equals_one_token_greedy_in_turn_and_all_at_once(pair, parallel, capsys):
    assert audit(pair, parallel=parallel) == []
    shared = [line for line in capsys.readouterr().err.splitlines() if "passes shared" in line]
    assert len(shared) == 3 * len(PROMPTS)
    most = max(int(line.split("up to ")[1].split()[0]) for line in shared)
    assert most == parallel  # all at once: some pass took every prompt's tree


def test_a_divergence_names_the_prompt_policy_and_first_token(pair, monkeypatch):
    sequential = exactness.sequential_cached

    def off_by_one_at_three(model, prompt, n, stop_ids):
        tokens = sequential(model, prompt, n, stop_ids)
        return [*tokens[:3], (tokens[3] + 1) % TINY_ARGS.vocab_size, *tokens[4:]]

    monkeypatch.setattr(exactness, "sequential_cached", off_by_one_at_three)
    found = audit(pair, parallel=2)
    assert {(d.prompt, d.policy, d.position) for d in found} == {
        (p.name, policy, 3) for p in PROMPTS for policy in ("chain-4", "gaincost", "lookup")
    }


def test_parallel_below_one_is_refused(pair):
    with pytest.raises(ConfigError, match="parallel = 0: expected >= 1"):
        audit(pair, parallel=0)


@pytest.mark.skipif(not plain.available(), reason="this CPU cannot run the plain kernels")
def test_the_plain_path_is_audited_beside_the_policies(capsys):
    quantized = model_pair(bf16_args(), "identical", dtype=torch.bfloat16, weights="q4k")
    found = check_exact(
        Path(quantized.target),
        Path(quantized.draft),
        PROMPTS,
        policies=["plain", "plain-lookup", "chain-4"],
        max_new_tokens=12,
        dram_budget=DramBudget("all"),
        draft_dtype="bfloat16",
    )
    assert found == []
    err = capsys.readouterr().err
    for policy in ("plain", "plain-lookup", "chain-4"):
        assert f"\n{policy}: 0 divergences" in err
    assert err.count("  plain ") == 2 * len(PROMPTS)


class _Words:
    """A tokenizer stand-in: a token a character; chat turns wrapped in brackets."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "[" + messages[-1]["content"] + "]"


def test_each_audit_prompt_has_a_name_of_its_own_beside_the_prose_set():
    """Names key the tokens found and their reference: the repetitive continuations and
    the prose set's passages must not share one (they did: prose-0 was compared with the
    other prose-0's reference, a divergence that was not)."""
    texts = {"prose": ["a passage", "another"], "humaneval": ["def f():"]}
    prompts = exactness.audit_prompts(_Words(), texts, 6)
    assert len({p.name for p in prompts}) == 6
    by_name = {p.name: p.tokens for p in prompts}
    assert by_name["prose-0"] == _Words().encode("[a passage]")
    assert by_name["repetitive-0"] == _Words().encode(exactness.REPETITIVE_PROSE[0])
