"""The gain-cost tree builder against synthetic cost models, and drafting ahead: the tree
grown below a sent tree while it is verified, handed over as the next step's tree."""

from __future__ import annotations

import pytest
import torch
import trio

from lever_actors.checkpoints.hf import load_hf
from lever_actors.device.units import Abandoned
from lever_actors.model.choosing import Chooser
from lever_actors.model.sampling import GREEDY
from lever_actors.model.transformer import Transformer
from lever_actors.policy.calibration import AcceptanceCalibrator
from lever_actors.policy.cost_model import CostModel, Curve
from lever_actors.policy.lookup import LOOKUP_RANK, ContextIndex
from lever_actors.policy.trees import KEPT, GainCostGrowth, TreeBuilder, grow_gain_cost
from tests.calibrators import learned
from tests.tiny_hf import save_tiny, tiny_model

PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Transformer:
    hf = save_tiny(tiny_model("qwen2", seed=4, layers=2), tmp_path_factory.mktemp("hf") / "d")
    checkpoint = load_hf(hf, torch.float64)
    return Transformer(checkpoint.args, checkpoint.weights)


def costs(*, io: float, verify_per_node: float, draft: float = 0.01) -> CostModel:
    return CostModel(
        flash_bandwidth=1e9,
        streamed_bytes=int(io * 1e9),
        verify=Curve([1, 128], [verify_per_node, 128 * verify_per_node]),
        draft=Curve([1, 64], [draft, 2 * draft]),
        project_seconds=1e-4,
        head_pass_seconds=0.0,
        contention=0.0,
    )


class Recorded:
    """A builder whose draft rounds are checked: every node run has its parent run."""

    def __init__(self, model: Transformer, chain: list[int] = PROMPT) -> None:
        self.builder = TreeBuilder(model, model.new_cache(256), chain, Chooser(GREEDY))
        self.builder.run_chain([])
        self.batches: list[list[int]] = []

    async def run(self, nodes: list[int]) -> None:
        for node in nodes:
            assert self.builder.parents[node] in self.builder.offsets, "parent not run"
        self.batches.append(list(nodes))
        self.builder.run(nodes)

    @property
    def draft_nodes(self) -> int:
        return len(self.builder.tokens) - self.builder.n_chain


def grown(
    model: Transformer,
    cost: CostModel,
    cap: int = 64,
    calibrator: AcceptanceCalibrator | None = None,
    context: ContextIndex | None = None,
) -> Recorded:
    recorded = Recorded(model)
    calibrator = calibrator or AcceptanceCalibrator()
    trio.run(grow_gain_cost, recorded.builder, cost, calibrator, cap, recorded.run, context)
    return recorded


def distribution(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """The draft's next-token distribution after `tokens`, computed afresh."""
    hidden = model.forward(torch.tensor(tokens), model.new_cache(len(tokens)))
    return torch.softmax(model.logits(hidden[-1:])[0], dim=-1)


def path_tokens(builder: TreeBuilder, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(builder.tokens[node])
        node = builder.parents[node]
    return path[::-1]


@pytest.mark.parametrize("cap", [1, 5, 17])
def test_the_tree_stops_at_the_cap_when_io_dwarfs_everything(draft, cap):
    recorded = grown(draft, costs(io=100.0, verify_per_node=1e-4), cap)
    assert recorded.draft_nodes == cap


def test_the_tree_grows_as_flash_time_rises(draft):
    sizes = [
        grown(draft, costs(io=io, verify_per_node=0.002)).draft_nodes for io in (0.0, 0.05, 0.1)
    ]
    assert sizes[0] < sizes[1] < sizes[2], sizes


def test_the_tree_shrinks_as_verification_gets_dearer(draft):
    sizes = [
        grown(draft, costs(io=0.3, verify_per_node=v)).draft_nodes for v in (1e-4, 0.008, 0.05)
    ]
    assert sizes[0] > sizes[1] > sizes[2], sizes


def test_below_a_prompt_a_node_must_pay_as_below_one_token(draft):
    """Where compute paces the pass and a node costs more than it is likely to save, the
    tree below a short chain has none, and so has the one below a 102-token prompt (priced
    with the prompt's rows in the pass's rate, 13 nodes looked worth it)."""
    cost, calibrator = costs(io=0.0, verify_per_node=0.008), AcceptanceCalibrator()
    for chain in (PROMPT, PROMPT * 17):
        recorded = Recorded(draft, chain)
        trio.run(grow_gain_cost, recorded.builder, cost, calibrator, 64, recorded.run)
        assert recorded.draft_nodes == 0, len(chain)


def test_fewer_rounds_where_the_target_often_refuses_first_choices(draft):
    """Another round is run on the hope that a child of the best new node is accepted as
    often as first choices have been: where the target refuses them, the rounds stop
    sooner (the refusals are of drafts at 0.55, which this tree's candidates do not share,
    so only that hope differs)."""
    refused = AcceptanceCalibrator()
    for _ in range(100):  # a first choice drafted at 0.55 below an accepted root, refused
        refused.observe((-1, 0), (1.0, 0.55), (0, 0), 1, (0,))
    assert refused.first_choice_rate() < 0.05 < 0.9 < AcceptanceCalibrator().first_choice_rate()
    cost = costs(io=0.3, verify_per_node=0.002, draft=0.02)
    hopeful, doubtful = grown(draft, cost), grown(draft, cost, calibrator=refused)
    assert len(doubtful.batches) < len(hopeful.batches)


def test_nodes_join_below_nodes_already_in_the_tree(draft):
    recorded = grown(draft, costs(io=2.0, verify_per_node=0.001))
    builder = recorded.builder
    assert all(parent < node for node, parent in enumerate(builder.parents) if node)
    assert recorded.batches, "a tree this cheap to verify should take several draft rounds"
    for node in range(builder.n_chain, len(builder.tokens)):  # children of run nodes only
        assert builder.parents[node] in builder.children


def test_drafting_ahead_grows_below_the_sent_tree_and_never_touches_it(draft):
    recorded = grown(draft, costs(io=0.5, verify_per_node=0.002))
    builder = recorded.builder
    sent = (tuple(builder.tokens), tuple(builder.parents))
    growth = GainCostGrowth(builder, costs(io=0.5, verify_per_node=0.002), learned(0.9))
    rounds = 0
    while trio.run(growth.grow_ahead, 4, 12, recorded.run):
        rounds += 1
    assert rounds > 0
    assert len(builder.tokens) - len(sent[0]) == 12  # up to the ahead cap
    assert (tuple(builder.tokens[: len(sent[0])]), tuple(builder.parents[: len(sent[0])])) == sent
    for batch in recorded.batches[-rounds:]:
        assert len(batch) <= 4


def test_no_round_ahead_where_no_node_is_likely_enough_to_be_used(draft):
    """A round ahead slows the pass beside it: it runs only while its best node may be
    accepted (AHEAD_WORTH), which a draft the target seldom follows never reaches."""
    recorded = grown(draft, costs(io=0.5, verify_per_node=0.002))
    growth = GainCostGrowth(recorded.builder, costs(io=0.5, verify_per_node=0.002), learned(0.1))
    batches = len(recorded.batches)
    assert not trio.run(growth.grow_ahead, 4, 20, recorded.run)
    assert len(recorded.batches) == batches


def test_a_subtree_drafted_ahead_becomes_the_next_tree_with_its_cache_intact(draft):
    """Accept a path, take a node drafted below its end as the target's next token: the
    rebased builder's distributions, old and new, equal fresh draft forwards of the text."""
    recorded = grown(draft, costs(io=0.5, verify_per_node=0.002), cap=6)
    builder = recorded.builder
    growth = GainCostGrowth(builder, costs(io=0.5, verify_per_node=0.002), learned(0.9))
    for _ in range(4):
        trio.run(growth.grow_ahead, 4, 20, recorded.run)
    ahead = range(growth.sent, len(builder.tokens))
    # the deepest node drafted ahead whose parent lies in the sent tree
    root = max(
        (n for n in ahead if builder.parents[n] < growth.sent and n in builder.offsets),
        key=lambda n: len(path_tokens(builder, n)),
    )
    end = builder.parents[root]
    accepted = []
    node = end
    while node >= 0:
        accepted.append(node)
        node = builder.parents[node]
    accepted = accepted[::-1]
    text = [builder.tokens[n] for n in accepted]
    length = builder.cache.length

    nxt = builder.rebase(accepted, root, cap=64)

    assert builder.cache.length == length + len(accepted)
    assert nxt.tokens[0] == builder.tokens[root] and nxt.n_chain == 1
    assert len(nxt.children) >= 1
    for node, children in nxt.children.items():
        assert_best_of(children, distribution(draft, text + path_tokens(nxt, node)))
    # and a new round on the rebased builder sees the moved entries
    leaf = max(nxt.children, key=lambda n: len(path_tokens(nxt, n)))
    token = nxt.children[leaf].tokens[0]
    child = nxt.add(leaf, token, 0.5, 0)
    nxt.run([child])
    assert_best_of(nxt.children[child], distribution(draft, text + path_tokens(nxt, child)))


def assert_best_of(children, fresh: torch.Tensor) -> None:
    """A node's kept children are the best of a fresh draft distribution, best first, with
    its probabilities (near-ties may take either order)."""
    fresh = fresh.float()
    assert len(children.tokens) == min(KEPT, fresh.numel())
    assert children.probs == sorted(children.probs, reverse=True)
    probs = torch.tensor(children.probs)
    torch.testing.assert_close(probs, fresh[children.tokens], rtol=1e-6, atol=1e-9)
    assert probs[-1] >= torch.topk(fresh, len(probs)).values[-1] - 1e-6


def test_a_round_that_pauses_between_layers_drafts_what_one_that_does_not_drafts(draft):
    """Drafting ahead runs its rounds with a pause after each layer (units.run_yielding)."""
    paused, steady = Recorded(draft), Recorded(draft)
    pauses = []
    for recorded, pause in ((paused, lambda: pauses.append(1)), (steady, None)):
        first = recorded.builder.children[len(PROMPT) - 1].tokens[:3]
        nodes = [recorded.builder.add(len(PROMPT) - 1, t, 0.5, r) for r, t in enumerate(first)]
        recorded.builder.run(nodes, pause=pause)
    assert len(pauses) == draft.args.n_layers
    assert paused.builder.children == steady.builder.children


def test_a_round_abandoned_midway_leaves_its_nodes_unrun_and_their_slots_free(draft):
    """A round ahead ends at a pause when the commit comes (units.Abandoned); a later round
    over the same nodes drafts what it would have drafted."""
    abandoned, steady = Recorded(draft), Recorded(draft)
    for recorded in (abandoned, steady):
        first = recorded.builder.children[len(PROMPT) - 1].tokens[:3]
        for r, t in enumerate(first):
            recorded.builder.add(len(PROMPT) - 1, t, 0.5, r)
    nodes = list(range(len(PROMPT), len(PROMPT) + 3))
    builder = abandoned.builder
    offsets, rounds = dict(builder.offsets), list(builder.rounds)
    pauses = []

    def pause() -> None:
        pauses.append(1)
        if len(pauses) == 2:
            raise Abandoned

    with pytest.raises(Abandoned):
        builder.run(nodes, pause=pause)
    assert builder.offsets == offsets and builder.rounds == rounds
    assert not set(nodes) & set(builder.children)
    builder.run(nodes)
    steady.builder.run(nodes)
    assert builder.children == steady.builder.children


def test_a_carried_trees_likeliest_leaf_not_yet_run_opens_the_first_round(draft):
    """The sent tree's last round runs none of its nodes: once its subtree is carried to
    the next step, the leaf on the likeliest path there is run, and the tree goes deeper."""
    recorded = grown(draft, costs(io=0.5, verify_per_node=0.002), cap=16)
    builder = recorded.builder
    root = max(builder.children, key=lambda n: len(path_tokens(builder, n)))
    assert root >= builder.n_chain  # a draft node that ran
    accepted = list(range(builder.n_chain))
    node = builder.parents[root]
    while node >= builder.n_chain:
        accepted.insert(builder.n_chain, node)
        node = builder.parents[node]
    carried = builder.rebase(accepted, root, cap=64)
    leaves = [n for n in range(1, len(carried.tokens)) if n not in carried.children]
    assert leaves  # the last round's nodes, never run
    growth = GainCostGrowth(carried, costs(io=0.5, verify_per_node=0.002), AcceptanceCalibrator())
    likeliest = max(leaves, key=growth.path_prob.__getitem__)
    ran: list[list[int]] = []

    async def run(nodes: list[int]) -> None:
        ran.append(list(nodes))
        carried.run(nodes)

    trio.run(growth.grow, 64, run)
    assert ran and likeliest in ran[0]


def planted(model: Transformer, run: list[int]) -> ContextIndex:
    """A committed text ending in PROMPT, in which PROMPT's last two tokens and the draft's
    first choice after PROMPT occurred before, followed by `run`."""
    first = int(distribution(model, PROMPT).argmax())
    return ContextIndex([*PROMPT[-2:], first, *run, *PROMPT])


def copies_below(builder: TreeBuilder, node: int) -> list[int]:
    """The tokens of the run of copies that hangs below `node`."""
    run = []
    while True:
        below = [c for c, p in enumerate(builder.parents) if p == node]
        copies = [c for c in below if builder.ranks[c] == LOOKUP_RANK]
        if not copies:
            return run
        node = copies[0]
        run.append(builder.tokens[node])


def test_copies_from_the_text_go_deep_without_a_draft_forward(draft):
    calibrator = AcceptanceCalibrator(copies_offered=100, copies_accepted=95)
    context = planted(draft, [7, 8, 9, 10, 11])
    recorded = grown(draft, costs(io=0.5, verify_per_node=0.002), 64, calibrator, context)
    builder = recorded.builder
    first = next(n for n in range(len(PROMPT), len(builder.tokens)) if builder.ranks[n] == 0)
    assert copies_below(builder, first)[:5] == [7, 8, 9, 10, 11]
    copied = {n for n, r in enumerate(builder.ranks) if r == LOOKUP_RANK}
    assert copied and not copied & {n for batch in recorded.batches for n in batch}  # never run
    assert all(builder.probs[n] == 0.0 for n in copied)


def test_a_token_both_copied_and_drafted_below_a_node_becomes_one_child(draft):
    """The text's copy below a node, offered before the node ran, and the draft's own offer
    once it did may hold the same token: whichever is taken first, there is one child."""
    first = int(distribution(draft, PROMPT).argmax())
    second = int(distribution(draft, [*PROMPT, first]).argmax())
    third = int(distribution(draft, [*PROMPT, first, second]).argmax())
    context = ContextIndex([*PROMPT[-2:], first, second, third, *PROMPT])
    calibrator = AcceptanceCalibrator(copies_offered=100, copies_accepted=10)
    for io in (0.2, 0.5, 2.0):
        builder = grown(draft, costs(io=io, verify_per_node=0.002), 64, calibrator, context).builder
        below = [
            (builder.parents[n], builder.tokens[n]) for n in range(len(PROMPT), len(builder.tokens))
        ]
        assert len(below) == len(set(below)), io


def test_no_copies_where_they_would_not_pay(draft):
    calibrator = AcceptanceCalibrator(copies_offered=100, copies_accepted=0)
    context = planted(draft, [7, 8, 9, 10, 11])
    recorded = grown(draft, costs(io=0.0, verify_per_node=0.05), 64, calibrator, context)
    assert LOOKUP_RANK not in recorded.builder.ranks


def test_without_the_text_no_copies(draft):
    recorded = grown(draft, costs(io=0.5, verify_per_node=0.002))
    assert LOOKUP_RANK not in recorded.builder.ranks
