"""The decode plan at start: auto prices each plan the memory limit holds (a draft in DRAM
leaves the target less) and takes the fastest; a plan may be forced; the config it loads
follows the plan (no draft for lookup or ar); where no plan fits, one line says why."""

from __future__ import annotations

import pytest

from lever_actors.cli import main
from lever_actors.config import EngineConfig
from lever_actors.device.budget import minimum_budget
from lever_actors.device.manifest import DTYPE_SIZES, read_manifest
from lever_actors.draft import load_draft
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError
from lever_actors.model.shapes import position_bytes
from lever_actors.paths import path_bytes
from lever_actors.plan import decode as decode_plan
from lever_actors.plan import memory as memory_module
from lever_actors.plan.context import room_bytes
from lever_actors.plan.decode import DecodePlan, choose_plan, given_plan, planned_config
from lever_actors.plan.memory import FEWEST_AUTO_CONTEXT
from lever_actors.policy.cost_model import Curve
from lever_actors.testing import TINY_ARGS, assert_matches_sequential, model_pair

PROCESS, LIBRARIES = 200 << 20, 80 << 20


@pytest.fixture(scope="module")
def pair():
    return model_pair(TINY_ARGS, "perturbed", 0, tokenizer="words")


def config_of(pair, **fields) -> EngineConfig:
    return EngineConfig(target=str(pair.target), draft=str(pair.draft), **fields)


def under(monkeypatch, limit: int) -> None:
    """The process holds PROCESS and its libraries LIBRARIES, under `limit`."""
    monkeypatch.setattr(memory_module, "anonymous_rss_bytes", lambda: PROCESS)
    monkeypatch.setattr(memory_module, "charged_file_bytes", lambda: LIBRARIES)
    monkeypatch.setattr(memory_module, "memory_limit_bytes", lambda: limit)


def least_limit(pair, draft: int) -> int:
    """The least limit that holds the target's least budget beside `draft` bytes."""
    manifest = read_manifest(pair.target)
    tokens = min(FEWEST_AUTO_CONTEXT, manifest.args.max_seq_len)  # the tiny model's 256
    room = room_bytes(position_bytes(manifest.args, DTYPE_SIZES[manifest.dtype]), tokens)
    return PROCESS + LIBRARIES + draft + room + minimum_budget(manifest)


def test_auto_prices_every_plan_where_memory_is_plentiful(pair, monkeypatch):
    under(monkeypatch, 8 << 30)
    config, plan = choose_plan(config_of(pair, plan="auto"), read_manifest(pair.target), False)
    assert plan.auto and set(plan.predicted) == {"trees", "lookup", "ar"}
    assert plan.name == max(plan.predicted, key=plan.predicted.__getitem__)
    assert all(rate > 0 for rate in plan.predicted.values())
    assert config.plan == plan.name
    assert (config.draft is not None) == (plan.name == "trees")
    assert str(plan).startswith(f"plan: {plan.name} (auto; predicted tok/s: trees ")


def test_a_limit_that_cannot_hold_the_draft_leaves_the_plans_without_one(pair, monkeypatch):
    draft = path_bytes(pair.draft)
    under(monkeypatch, least_limit(pair, draft) - 1)  # one byte short beside the draft
    config, plan = choose_plan(config_of(pair, plan="auto"), read_manifest(pair.target), False)
    assert set(plan.predicted) == {"lookup", "ar"}
    assert config.draft is None
    assert config.tree.kind == ("lookup" if plan.name == "lookup" else "none")


def test_a_limit_that_holds_no_plan_is_refused_in_one_line(pair, monkeypatch):
    under(monkeypatch, least_limit(pair, 0) - 1)
    measured = []  # the machine's figures: not measured where nothing can fit
    monkeypatch.setattr(decode_plan, "target_figures", lambda *a: measured.append(a))
    with pytest.raises(ConfigError) as refused:
        choose_plan(config_of(pair, plan="auto"), read_manifest(pair.target), False)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("a memory limit of ")
    assert "room for 256 tokens of context" in message
    assert message.endswith("raise the limit or lower ctx_size")
    assert measured == []


def test_a_plan_given_is_followed_and_no_plan_keeps_the_tree(pair):
    manifest = read_manifest(pair.target)
    config, plan = choose_plan(config_of(pair, plan="ar"), manifest, False)
    assert (str(config.tree), config.draft, plan) == ("none", None, DecodePlan("ar", False))
    config, plan = choose_plan(config_of(pair, plan="lookup"), manifest, False)
    assert (str(config.tree), config.draft) == ("lookup:64", None)
    given = config_of(pair, tree="chain:3")
    assert choose_plan(given, manifest, False) == (given, DecodePlan("trees", False))
    assert given_plan(config_of(pair, tree="none")).name == "ar"
    with pytest.raises(ConfigError, match="plan 'trees' needs a draft model"):
        choose_plan(EngineConfig(target=str(pair.target), plan="trees"), manifest, False)


async def test_a_draft_passed_loaded_is_the_trees_plans_draft(pair):
    """A draft handed to Engine.open (config.draft None) drafts Lever's trees under the
    trees plan, not the "none" a config without a draft reads as; a lookup tree given is
    kept with its cap."""
    config = EngineConfig(target=str(pair.target), plan="trees")
    assert planned_config(config, "trees", True).tree.kind == "gaincost"
    assert str(planned_config(config_of(pair, tree="lookup:5"), "lookup", False).tree) == "lookup:5"
    draft = load_draft(str(pair.draft), "float64", "dense")
    async with Engine.open(config, draft=draft) as engine:
        assert str(engine.config.tree) == "gaincost:64"
        assert engine.draft is not None
        result = await engine.generate([5, 6, 7, 8], max_new_tokens=12)
    assert any(s.draft_rounds for s in result.steps)


async def test_the_lookup_plan_loads_no_draft_and_stays_exact(pair):
    config = config_of(pair, plan="lookup")
    async with Engine.open(config) as engine:
        assert engine.draft is None
        assert engine.plan.decode == DecodePlan("lookup", False)
        assert engine.plan.memory.draft < (1 << 20)
    await assert_matches_sequential(config, [5, 6, 7, 8, 9] * 4, 30)


def test_generate_prints_the_plan_and_refuses_a_limit_too_small_in_one_line(
    pair, capsys, monkeypatch
):
    where = ["--target", str(pair.target), "--draft", str(pair.draft), "--prompt", "t3 t1"]
    assert main(["generate", *where, "--max-new-tokens", "4"]) == 0
    assert "plan: " in capsys.readouterr().err  # auto: no --tree given
    monkeypatch.setattr(memory_module, "memory_limit_bytes", lambda: 64 << 20)
    assert main(["generate", *where, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lever-actors: error: a memory limit of 64.0 MiB leaves nothing")
    assert err.count("\n") == 1


def test_trees_chosen_copy_from_the_fewest_requests_at_once_whose_copies_are_priced_faster(
    pair, monkeypatch
):
    under(monkeypatch, 8 << 30)
    rates = {"trees": lambda n: 10.0, "lookup": lambda n: 4.0 * n, "ar": lambda n: 1.0}
    monkeypatch.setattr(decode_plan, "_rate", lambda cost, plan, together: rates[plan](together))
    manifest = read_manifest(pair.target)
    _, plan = choose_plan(config_of(pair, plan="auto"), manifest, False)
    assert plan.name == "trees" and plan.copies_from == 3  # 12 tok/s against 10
    assert str(plan).endswith("; copies from 3 at once)")
    # two at most: copies are never faster, the trees stay
    _, plan = choose_plan(config_of(pair, plan="auto", parallel=2), manifest, False)
    assert plan.name == "trees" and plan.copies_from is None
    rates["trees"] = lambda n: 1.0  # copies chosen: nothing to switch
    _, plan = choose_plan(config_of(pair, plan="auto"), manifest, False)
    assert plan.name == "lookup" and plan.copies_from is None


def test_trees_pay_for_the_drafts_run_of_each_prompt(pair, monkeypatch):
    """A drafting plan's rate counts a draft prefill row per token decoded; the others not.
    Rounds of one or two nodes cost only a round's overhead here, a 32-row forward 0.1 s a
    row (and its round's overhead, shared by its rows)."""
    under(monkeypatch, 8 << 30)
    config, manifest = config_of(pair, plan="auto"), read_manifest(pair.target)
    _, plan = choose_plan(config, manifest, False)
    dear = Curve([1, 2, decode_plan.DRAFT_PREFILL_ROWS], [1e-9, 2e-9, 3.2])
    monkeypatch.setattr(decode_plan, "draft_curve", lambda config, figures: dear)
    _, priced = choose_plan(config, manifest, False)
    assert priced.predicted["trees"] < 10  # at most a token per 0.1 s prompt row
    for name in ("lookup", "ar"):
        assert priced.predicted[name] == plan.predicted[name]
    monkeypatch.setattr(decode_plan, "PROMPT_ROWS_PER_TOKEN", 0.0)
    _, unpriced = choose_plan(config, manifest, False)
    # a 0.1 s prompt row per token on top of the unpriced rate's seconds a token
    row = (3.2 + decode_plan.DRAFT_ROUND_OVERHEAD_SECONDS) / decode_plan.DRAFT_PREFILL_ROWS
    expected = 1 / (1 / unpriced.predicted["trees"] + row)
    assert priced.predicted["trees"] == pytest.approx(expected, rel=1e-9)


def test_a_draft_round_is_priced_beyond_its_profiled_forward(pair, monkeypatch):
    """Each draft round costs the plan DRAFT_ROUND_OVERHEAD_SECONDS beyond the profiled
    forward (its hand-offs and ranking in the engine): dearer rounds lower the trees'
    predicted rate and leave the plans that do not draft as they were."""
    under(monkeypatch, 8 << 30)
    config, manifest = config_of(pair, plan="auto"), read_manifest(pair.target)
    monkeypatch.setattr(decode_plan, "DRAFT_ROUND_OVERHEAD_SECONDS", 0.0)
    _, bare = choose_plan(config, manifest, False)
    monkeypatch.setattr(decode_plan, "DRAFT_ROUND_OVERHEAD_SECONDS", 0.05)
    _, dear = choose_plan(config, manifest, False)
    assert dear.predicted["trees"] < bare.predicted["trees"]
    for name in ("lookup", "ar"):
        assert dear.predicted[name] == bare.predicted[name]
