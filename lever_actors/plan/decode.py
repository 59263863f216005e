"""How tokens are proposed, chosen at start for the memory there is (`plan="auto"`): a
draft model's gain-cost trees, copies from the text alone, or one token a pass. Each
candidate gets its own memory plan (a draft in DRAM leaves the target less), hence its own
streamed bytes; the cost model (policy/cost_model.py) prices a pass of the shape that
candidate's trees take, for as many requests at once as `parallel` gives (one where it is
automatic), with this machine's figures (policy/figures.py); the most tokens per second
wins. A candidate whose memory plan is refused is not a candidate; where none fits,
the refusal of the one that needs least is the engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from lever_actors.channels.messages import Beside
from lever_actors.config import DEFAULT_TREE, EngineConfig, TreeSpec
from lever_actors.device.budget import head_key, plan_residency
from lever_actors.device.manifest import Manifest
from lever_actors.device.memory import return_freed_heap
from lever_actors.errors import ConfigError
from lever_actors.paths import path_bytes
from lever_actors.plan.memory import Reading, memory_plan, read_process
from lever_actors.plan.parallel import MAX_AUTO_PARALLEL
from lever_actors.policy.cost_model import CostModel, Curve
from lever_actors.policy.figures import draft_curve, target_figures

PlanName = Literal["trees", "lookup", "ar"]


class Shape(msgspec.Struct, frozen=True):
    """A step's tree as a plan grows it: tokens committed, nodes verified, draft rounds."""

    tokens: float
    nodes: int
    rounds: tuple[int, ...] = ()


# Measured on the real pair (a 2-core Xeon, 2026-12-03: 2 HumanEval and 2 ShareGPT prompts,
# 64 tokens each, and one under a 1.25 GiB limit), means over steps. Trees grow where flash
# paces the pass, since nodes then cost little; copies pay only where the text repeats
# itself (4.9 tokens a pass on one prompt, 1.0-1.05 on the others: the median is priced).
# Resident trees: the mean of a code, a chat and a prose prompt's (3.3, 1.9 and 2.1 tokens
# a pass; 2-core EPYC, 2026-12-07, 128 tokens each), since code's alone priced them above
# the copies that ran 1.1-1.3x as fast on each of the three.
SHAPES: dict[tuple[PlanName, bool], Shape] = {  # (plan, flash paces the pass)
    ("trees", False): Shape(tokens=2.4, nodes=3, rounds=(2, 1)),
    ("trees", True): Shape(tokens=5.0, nodes=15, rounds=(4, 4, 4, 3)),
    ("lookup", False): Shape(tokens=1.05, nodes=1),
    ("lookup", True): Shape(tokens=1.05, nodes=2),
    ("ar", False): Shape(tokens=1.0, nodes=1),
    ("ar", True): Shape(tokens=1.0, nodes=1),
}
# a step's time beyond its draft rounds, the profiled pass and projection (each layer's
# hand-off between threads, the sampler, the event loop): a resident one-token step took
# 52 ms where the profile priced its pass and projection at 42
STEP_OVERHEAD_SECONDS = 0.010
# a draft round beyond its profiled forward (its hand-offs to the verifier's unit, its
# placement and ranking): a resident code step's 1.8 rounds took 33 ms where the profile
# priced 21 (2-core Zen 4; a bare forward of one node 10 ms, in the engine's unit too), and
# priced without it trees were chosen where copies ran 1.13x as fast
DRAFT_ROUND_OVERHEAD_SECONDS = 0.006
# trees run each request's prompt through the draft too (a 347-token prompt took the draft
# 1.6 s beside a 128-token answer's 8 s, resident, 2-core EPYC): priced as if a prompt were
# as long as its answer, each row at a DRAFT_PREFILL_ROWS-row forward's share, which
# projects every row (9.4 ms a row there: twice that prompt's, an upper bound)
PROMPT_ROWS_PER_TOKEN = 1.0
DRAFT_PREFILL_ROWS = 32


class DecodePlan(msgspec.Struct, frozen=True):
    """The plan an engine decodes by (`Engine.plan.decode`), and why."""

    name: PlanName
    auto: bool  # chosen by the cost model, not given
    predicted: dict[str, float] = {}  # tokens per second each candidate was predicted
    # trees chosen: the fewest requests decoding together whose pass copies of the text
    # (the draft kept) are priced faster in, from which each step of theirs copies
    copies_from: int | None = None

    def __str__(self) -> str:
        if not self.auto:
            return f"plan: {self.name}"
        figures = ", ".join(f"{name} {rate:.1f}" for name, rate in self.predicted.items())
        batch = f"; copies from {self.copies_from} at once" if self.copies_from else ""
        return f"plan: {self.name} (auto; predicted tok/s: {figures}{batch})"


def given_plan(config: EngineConfig) -> DecodePlan:
    """The plan a config's tree makes, where no plan was asked for."""
    kind = config.tree.kind
    return DecodePlan("ar" if kind == "none" else "lookup" if kind == "lookup" else "trees", False)


def planned_config(config: EngineConfig, name: PlanName, draft_loaded: bool) -> EngineConfig:
    """`config` as plan `name` decodes: trees keep a drafting tree (else Lever's default);
    lookup and ar load no draft. `draft_loaded`: the caller holds a draft model already."""
    if name == "trees":
        if config.draft is None and not draft_loaded:
            raise ConfigError("plan 'trees' needs a draft model; set draft")
        # a copy of the default: the default itself, with no draft named, reads as "none"
        tree = (
            config.tree if config.tree.needs_draft else TreeSpec("gaincost", cap=DEFAULT_TREE.cap)
        )
        return msgspec.structs.replace(config, tree=tree, plan=name)
    if name == "lookup":
        tree = (
            config.tree
            if config.tree.kind == "lookup"
            else TreeSpec("lookup", cap=DEFAULT_TREE.cap)
        )
    else:
        tree = TreeSpec("none")
    return msgspec.structs.replace(config, tree=tree, draft=None, plan=name)


def choose_plan(
    config: EngineConfig, manifest: Manifest, draft_loaded: bool
) -> tuple[EngineConfig, DecodePlan]:
    """The config to load and the plan it follows; blocking where `plan` is auto (the first
    time on a machine, its figures are measured). `draft_loaded`: the caller passes a draft
    model already in memory."""
    if config.plan is None:  # a draft named but not drafting from is not loaded, nor profiled
        drafting = config.tree.needs_draft
        return config if drafting else msgspec.structs.replace(config, draft=None), given_plan(
            config
        )
    if config.plan != "auto":
        return planned_config(config, config.plan, draft_loaded), DecodePlan(config.plan, False)
    # the plan that needs least memory first: a limit too small for it is refused before
    # the figures are measured, and they are measured within what it may hold
    least = memory_plan(
        planned_config(config, "ar", draft_loaded), manifest, read_process(), draft=0
    )
    figures = target_figures(config, manifest, least.budget)
    return_freed_heap()  # where it measured them: its temporaries
    reading = read_process()  # once, for every candidate
    drafts = config.draft is not None or draft_loaded
    names: list[PlanName] = ["trees", "lookup", "ar"] if drafts else ["lookup", "ar"]
    together = config.parallel or 1  # as many requests as the config asks for, else one
    costs: dict[PlanName, CostModel] = {}
    refusal: ConfigError | None = None
    for name in names:
        try:
            costs[name] = _cost(
                planned_config(config, name, draft_loaded), manifest, reading, figures, draft_loaded
            )
        except ConfigError as error:
            refusal = error  # the last is the one that needs least memory
    if not costs:
        assert refusal is not None
        raise refusal
    predicted: dict[str, float] = {
        name: _rate(cost, name, together) for name, cost in costs.items()
    }
    best = max(costs, key=predicted.__getitem__)
    copies_from = None
    if best == "trees":  # priced under the trees' memory plan: the draft stays
        most = config.parallel or MAX_AUTO_PARALLEL
        trees = costs["trees"]
        faster = (
            n for n in range(2, most + 1) if _rate(trees, "lookup", n) > _rate(trees, "trees", n)
        )
        copies_from = next(faster, None)
    chosen = planned_config(config, best, draft_loaded)
    return chosen, DecodePlan(best, True, predicted, copies_from)


def _cost(
    config: EngineConfig,
    manifest: Manifest,
    reading: Reading,
    figures: CostModel,
    draft_loaded: bool,
) -> CostModel:
    """The cost model of `config`'s plan: this machine's figures, the flash reads its memory
    plan leaves, its draft's rounds; ConfigError where the limit cannot hold it."""
    drafts = config.tree.needs_draft
    held = path_bytes(Path(config.draft)) if drafts and config.draft and not draft_loaded else 0
    memory = memory_plan(config, manifest, reading, draft=held)
    residency = plan_residency(manifest, memory.budget, config.ring_slots)
    head = manifest.extent(head_key(manifest)).nbytes
    cost = msgspec.structs.replace(
        figures,
        streamed_bytes=sum(manifest.layer(i).nbytes for i in residency.streamed_layers),
        head_bytes=head if residency.head_rows_per_read else 0,
        overhead_seconds=STEP_OVERHEAD_SECONDS,
    )
    if drafts:
        forward = draft_curve(config, figures)
        cost.draft = Curve(
            forward.sizes, [s + DRAFT_ROUND_OVERHEAD_SECONDS for s in forward.seconds]
        )
    return cost


def _rate(cost: CostModel, plan: PlanName, together: int) -> float:
    """Tokens per second of a pass of `together` requests whose steps take `plan`'s shape,
    with the draft's run of their prompts where the plan drafts."""
    paced = cost.io_bound(together * SHAPES[plan, True].nodes)
    shape = SHAPES[plan, paced]
    others = together - 1
    beside = Beside(others, others * shape.nodes, others * shape.tokens)
    rate = cost.pass_rate(shape.nodes, list(shape.rounds), shape.tokens, beside)
    if not shape.rounds:
        return rate
    prefill_row = cost.draft(DRAFT_PREFILL_ROWS) / DRAFT_PREFILL_ROWS
    return 1 / (1 / rate + PROMPT_ROWS_PER_TOKEN * prefill_row)
