"""The projector alone: final hidden states in, verdicts out. The verdict walks the target's
argmax path through the tree. The LM head runs along that path (batched with the drafter's
predicted continuation of it), never over the whole tree: when the drafter's ranking is
right, exactly once per accepted token plus the bonus."""

from __future__ import annotations

import contextlib

import pytest
import torch
import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.actors.projector import Projector
from lever_actors.channels.messages import DraftTree, FinalHidden, Verdict
from lever_actors.checkpoints.hf import load_hf
from lever_actors.device.units import ComputeUnit
from lever_actors.model.placement import tree_placement
from lever_actors.model.sequential import sequential_reference
from lever_actors.model.transformer import Transformer
from lever_actors.model.tree import TokenTree
from tests.tiny_hf import save_tiny, tiny_model

PROMPT = [3, 14, 15, 92, 65]
TIMEOUT = 20


@pytest.fixture(scope="module", params=["qwen2", "llama-tied"])
def model(request, tmp_path_factory) -> Transformer:
    arch, tie = ("llama", True) if request.param == "llama-tied" else (request.param, False)
    hf = save_tiny(tiny_model(arch, seed=4, layers=2, tie=tie), tmp_path_factory.mktemp("hf") / "m")
    checkpoint = load_hf(hf, torch.float64)
    return Transformer(checkpoint.args, checkpoint.weights)


@pytest.fixture(scope="module")
def greedy(model) -> list[int]:
    return sequential_reference(model, PROMPT, 5)


def other(token: int, k: int = 1) -> int:
    """A token that is not `token` (the k-th such)."""
    return (token + 10 * k) % 97


def tree_message(step: int, committed: list[int], drafts: list[tuple[int, int]]) -> DraftTree:
    """drafts: (parent, token) below the committed chain, parents as absolute node indices."""
    n = len(committed)
    parents = tuple(range(-1, n - 1)) + tuple(p for p, _ in drafts)
    tokens = tuple(committed) + tuple(t for _, t in drafts)
    return DraftTree(
        step=step,
        tokens=tokens,
        parents=parents,
        n_committed=n,
        draft_probs=(1.0,) * len(tokens),
        # as the drafter ranks them: siblings in the order they were added, best first
        draft_ranks=tuple(parents[:i].count(p) for i, p in enumerate(parents)),
        shadows=((),) * len(tokens),
        draft_seconds=0.25,
        draft_rounds=(),
    )


def final_hidden(
    model: Transformer,
    tree: DraftTree,
    context: list[int] = (),
    live: list[int] | None = None,
    audit: bool = False,
    would_drop: tuple[int, ...] = (),
) -> FinalHidden:
    """What the verifier would send: the target's last-layer states of the live nodes."""
    t = TokenTree(tree.tokens, tree.parents)
    cache = model.new_cache(len(context) + len(t))
    if context:
        model.forward(torch.tensor(list(context)), cache)
        cache.commit(len(context))
    place = tree_placement(model.rope, cache.length, t, model.dtype)
    hidden = model.forward(torch.tensor(t.tokens), cache, place)
    live = list(range(len(t))) if live is None else live
    return FinalHidden(
        step=tree.step,
        tree=tree,
        position=len(context),
        nodes=tuple(live),
        hidden=hidden[live],
        io_wait_seconds=0.5,
        verify_seconds=0.75,
        project_seconds=0.25,
        pruned=len(t) - len(live),
        saved_node_layers=3 * (len(t) - len(live)),
        probe_seconds=0.0,
        audit=audit,
        would_drop=would_drop,
    )


def big_tree(greedy: list[int]) -> DraftTree:
    """Prompt (nodes 0-4), then: 5 wrong, 6 = g1 -> {7 wrong -> {12, 13, 14}, 8 = g2 ->
    {10 wrong, 11 wrong}}, 9 = g2 below the wrong 5, plus more wrong leaves. The target's
    path is 4 -> 6 -> 8, then a bonus (g3) that no child of 8 holds."""
    g1, g2, g3 = greedy[:3]
    drafts = [
        (4, other(g1)),  # 5
        (4, g1),  # 6
        (6, other(g2)),  # 7
        (6, g2),  # 8
        (5, g2),  # 9
        (8, other(g3)),  # 10
        (8, other(g3, 2)),  # 11
        (7, 1),  # 12
        (7, 2),  # 13
        (7, 4),  # 14
        (4, other(g1, 2)),  # 15
        (15, g2),  # 16
    ]
    return tree_message(0, PROMPT, drafts)


def good_tree(greedy: list[int]) -> DraftTree:
    """The drafter ranked the target's choices first: 4 -> {5 = g1 -> {7 = g2, 8}, 6}; the
    walk accepts 5 and 7 and ends at the leaf 7 with the bonus g3."""
    g1, g2, _ = greedy[:3]
    drafts = [(4, g1), (4, other(g1)), (5, g2), (5, other(g2))]
    return tree_message(0, PROMPT, drafts)


class LMHeadSpy:
    """Records the hidden rows that go through final norm + LM head."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    @property
    def rows(self) -> int:
        return sum(b.shape[0] for b in self.batches)

    def nodes(self, final: FinalHidden) -> list[int]:
        """The tree nodes whose hidden rows were projected, in order."""
        out = []
        for batch in self.batches:
            for h in batch:
                match = [i for i, row in enumerate(final.hidden) if torch.equal(row, h)]
                assert len(match) == 1
                out.append(final.nodes[match[0]])
        return out


@contextlib.contextmanager
def spying_lm_head(monkeypatch):
    spy = LMHeadSpy()
    real = Transformer.logits

    def spying(self, hidden):
        spy.batches.append(hidden.clone())
        return real(self, hidden)

    monkeypatch.setattr(Transformer, "logits", spying)
    yield spy


def predicted_chain(final: FinalHidden, node: int) -> list[int]:
    """`node`, then each time its live child the drafter ranked best."""
    tree = TokenTree(final.tree.tokens, final.tree.parents)
    chain = [node]
    while live := [c for c in tree.children(chain[-1]) if c in final.nodes]:
        chain.append(min(live, key=lambda c: final.tree.draft_ranks[c]))
    return chain


def check_lm_head_work(spy: LMHeadSpy, final: FinalHidden, verdict: Verdict) -> None:
    """Projected: every node of the walk, each once, plus nothing beyond the drafter's
    predicted continuations of the walk's nodes."""
    walked = [final.tree.n_committed - 1, *verdict.accepted[final.tree.n_committed :]]
    projected = spy.nodes(final)
    assert verdict.stats.projected_nodes == spy.rows == len(projected) == len(set(projected))
    assert set(walked) <= set(projected)
    allowed = {n for node in walked for n in predicted_chain(final, node)}
    assert set(projected) <= allowed


def projector(model: Transformer, eager: bool = False) -> Projector:
    # looked up at each call, so that a spy set on the class sees it
    return Projector(lambda h: model.logits(h), ComputeUnit("cpu"), Jitter(0, 0), eager)


async def project(proj: Projector, *finals: FinalHidden) -> list[Verdict]:
    """Run the actor over these messages, close its inbox, and see it close its outbox."""
    send, inbox = trio.open_memory_channel[FinalHidden](len(finals))
    outbox, receive = trio.open_memory_channel[Verdict](len(finals))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(proj.run, inbox, outbox)
            async with send, receive:
                verdicts = []
                for final in finals:
                    await send.send(final)
                    verdicts.append(await receive.receive())
                await send.aclose()
                with pytest.raises(trio.EndOfChannel):
                    await receive.receive()
    return verdicts


async def test_verdict_walks_the_argmax_path_projecting_each_accepted_node_once(
    model, greedy, monkeypatch
):
    tree = good_tree(greedy)
    final = final_hidden(model, tree)
    with spying_lm_head(monkeypatch) as spy:
        (verdict,) = await project(projector(model), final)
    n = len(PROMPT)
    assert verdict.step == 0
    assert verdict.accepted == (*range(n), 5, 7)
    assert verdict.tokens == tuple(greedy[:3])
    assert verdict.from_draft == (True, True, False)
    # the drafter ranked right: the LM head ran once per accepted token plus the bonus
    assert verdict.stats.projected_nodes == spy.rows == 3
    assert spy.nodes(final) == [4, 5, 7]
    assert verdict.stats.tree_nodes == len(tree.tokens) and verdict.stats.live_nodes == len(
        tree.tokens
    )
    # the pass's chains' projection, and the walk's own on top
    assert verdict.stats.project_seconds >= 0.25
    # timings and pruning figures pass through from the verifier and the drafter
    assert (verdict.stats.io_wait_seconds, verdict.stats.verify_seconds) == (0.5, 0.75)
    assert verdict.stats.draft_seconds == 0.25
    assert (verdict.stats.pruned, verdict.stats.saved_node_layers) == (0, 0)
    assert (verdict.stats.audited, verdict.stats.false_prunes) == (False, 0)


async def test_a_misranked_bushy_tree_is_still_not_projected_whole(model, greedy, monkeypatch):
    tree = big_tree(greedy)
    final = final_hidden(model, tree)
    with spying_lm_head(monkeypatch) as spy:
        (verdict,) = await project(projector(model), final)
    n = len(PROMPT)
    assert verdict.accepted == (*range(n), 6, 8)
    assert verdict.tokens == tuple(greedy[:3])
    assert verdict.from_draft == (True, True, False)
    check_lm_head_work(spy, final, verdict)
    assert verdict.stats.projected_nodes < len(tree.tokens) - n  # fewer than the draft nodes


async def test_eager_projection_gives_the_same_verdict_projecting_every_reachable_node(
    model, greedy, monkeypatch
):
    tree = big_tree(greedy)
    live = [n for n in range(len(tree.tokens)) if n != 13]
    final = final_hidden(model, tree, live=live)
    (lazy,) = await project(projector(model), final)
    with spying_lm_head(monkeypatch) as spy:
        (eager,) = await project(projector(model, eager=True), final)
    assert eager.accepted == lazy.accepted and eager.tokens == lazy.tokens
    assert eager.from_draft == lazy.from_draft
    # every live node from the last committed one on: the walk cannot reach those before it
    reachable = [n for n in live if n >= tree.n_committed - 1]
    assert eager.stats.projected_nodes == len(reachable) == spy.rows
    assert len(reachable) < len(live)


async def test_a_fully_accepted_chain_ends_with_the_bonus_token(model, greedy, monkeypatch):
    n = len(PROMPT)
    tree = tree_message(0, PROMPT, [(n - 1 + i, g) for i, g in enumerate(greedy[:4])])
    with spying_lm_head(monkeypatch) as spy:
        (verdict,) = await project(projector(model), final_hidden(model, tree))
    assert verdict.accepted == tuple(range(n + 4))
    assert verdict.tokens == tuple(greedy[:5])
    assert verdict.from_draft == (True,) * 4 + (False,)
    assert verdict.stats.projected_nodes == spy.rows == 5
    assert len(spy.batches) == 1  # the predicted chain went through the LM head at once


@pytest.mark.parametrize(
    ("live_without", "accepted_drafts", "n_tokens"),
    [
        pytest.param({6, 7, 8, 10, 11, 12, 13, 14}, (), 1, id="first-step-pruned"),
        pytest.param({8, 10, 11}, (6,), 2, id="second-step-pruned"),
        pytest.param({10, 11}, (6, 8), 3, id="wrong-leaves-pruned"),
    ],
)
async def test_a_pruned_child_is_never_followed(
    model, greedy, monkeypatch, live_without, accepted_drafts, n_tokens
):
    tree = big_tree(greedy)
    live = [n for n in range(len(tree.tokens)) if n not in live_without]
    final = final_hidden(model, tree, live=live)
    with spying_lm_head(monkeypatch) as spy:
        (verdict,) = await project(projector(model), final)
    check_lm_head_work(spy, final, verdict)
    assert verdict.accepted == (*range(len(PROMPT)), *accepted_drafts)
    # the bonus still comes from the target's own full-depth logits
    assert verdict.tokens == tuple(greedy[:n_tokens])
    assert verdict.from_draft == (True,) * (n_tokens - 1) + (False,)
    assert verdict.stats.live_nodes == len(live)
    assert verdict.stats.pruned == len(tree.tokens) - len(live)


async def test_no_draft_nodes_gives_one_token_and_steps_follow_in_order(model, greedy):
    first = tree_message(0, PROMPT, [])
    second = tree_message(1, [greedy[1]], [(0, other(greedy[2])), (0, greedy[2])])
    verdicts = await project(
        projector(model),
        final_hidden(model, first),
        final_hidden(model, second, PROMPT + greedy[:1]),
    )
    assert [v.step for v in verdicts] == [0, 1]
    assert verdicts[0].accepted == tuple(range(len(PROMPT)))
    assert verdicts[0].tokens == (greedy[0],) and verdicts[0].from_draft == (False,)
    assert verdicts[1].accepted == (0, 2)
    assert verdicts[1].tokens == tuple(greedy[2:4])
    assert verdicts[1].from_draft == (True, False)


async def test_false_prunes_count_accepted_nodes_an_audit_would_have_dropped(model, greedy):
    tree = big_tree(greedy)
    final = final_hidden(model, tree, audit=True, would_drop=(5, 8, 10, 11, 9))
    (verdict,) = await project(projector(model), final)
    assert verdict.stats.audited
    assert verdict.accepted[-2:] == (6, 8)
    assert verdict.stats.false_prunes == 1  # node 8 was accepted


async def test_an_error_in_the_walk_propagates_from_run(model, greedy, monkeypatch):
    class WalkBroke(Exception):
        pass

    def broken(self, final):
        raise WalkBroke(f"cannot walk step {final.step}")

    monkeypatch.setattr(Projector, "walk", broken)
    send, inbox = trio.open_memory_channel[FinalHidden](1)
    outbox, receive = trio.open_memory_channel[Verdict](1)
    with trio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(pytest.RaisesExc(WalkBroke, match="cannot walk step 0")):
            async with trio.open_nursery() as nursery:
                await nursery.start(projector(model).run, inbox, outbox)
                async with send, receive:
                    await send.send(final_hidden(model, big_tree(greedy)))
                    with contextlib.suppress(trio.EndOfChannel):
                        await receive.receive()
