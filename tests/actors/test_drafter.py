"""The drafter alone: requests and commits in, trees out; its trees are the draft model's
own greedy/top-k continuations of the committed text, whatever it kept from earlier steps."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import trio

from lever_actors.actors.drafter import Drafter, DrafterInbox, DraftPolicy
from lever_actors.actors.jitter import Jitter
from lever_actors.channels.messages import Beside, Commit, DraftRequest, DraftTree
from lever_actors.checkpoints.hf import load_hf
from lever_actors.config import TreeSpec
from lever_actors.device.units import ComputeUnit
from lever_actors.model.sequential import sequential_reference
from lever_actors.model.transformer import Transformer
from lever_actors.model.tree import TokenTree
from lever_actors.policy.cost_model import CostModel, Curve
from lever_actors.policy.trees import TreeBuilder
from tests.calibrators import learned
from tests.tiny_hf import save_tiny, tiny_model
from tests.torch_ops import OpsOnThisThread

PROMPT = [3, 14, 15, 92, 65]
TIMEOUT = 20


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def draft(request, tmp_path_factory) -> Transformer:
    hf = save_tiny(tiny_model(request.param, seed=1, layers=2), tmp_path_factory.mktemp("hf") / "d")
    checkpoint = load_hf(hf, torch.float64)
    return Transformer(checkpoint.args, checkpoint.weights)


class Wired:
    """A drafter in a nursery with channels we hold the other ends of."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.requests, requests = trio.open_memory_channel[DraftRequest](1)
        self.commits, commits = trio.open_memory_channel[Commit](1)
        trees, self.trees = trio.open_memory_channel[DraftTree](1)
        self.inbox = DrafterInbox(requests, commits)
        self.outbox = trees

    @contextlib.asynccontextmanager
    async def running(self):
        """The drafter started in a nursery, our channel ends open; leaving closes them."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.drafter.run, self.inbox, self.outbox)
            async with self.requests, self.commits, self.trees:
                yield

    async def draft(self, step: int, max_nodes: int) -> DraftTree:
        await self.requests.send(DraftRequest(step=step, max_nodes=max_nodes))
        return await self.trees.receive()


def drafter(model, spec: str, prompt=PROMPT) -> Drafter:
    policy = DraftPolicy(TreeSpec.parse(spec))
    units = (ComputeUnit("cpu"), ComputeUnit("npu"))
    cache = model.new_cache(len(prompt) + 64) if model else None
    return Drafter(model, policy, list(prompt), cache, units, Jitter(0, 0))


def distribution(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """The draft model's next-token distribution after `tokens` (fresh, no cache reuse)."""
    hidden = model.forward(torch.tensor(tokens), model.new_cache(len(tokens)))
    return torch.softmax(model.logits(hidden[-1:])[0], dim=-1)


def check_committed_chain(tree: DraftTree, committed: list[int]) -> None:
    n = len(committed)
    assert tree.n_committed == n
    assert list(tree.tokens[:n]) == committed
    assert tree.parents[:n] == tuple(range(-1, n - 1))
    assert tree.draft_probs[:n] == (1.0,) * n
    TokenTree(tree.tokens, tree.parents)  # well formed
    assert len(tree.draft_probs) == len(tree.tokens)


async def test_chain_is_the_draft_models_greedy_continuation(draft):
    wired = Wired(drafter(draft, "chain:4"))
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            tree = await wired.draft(0, 4)
    assert tree.step == 0
    check_committed_chain(tree, PROMPT)
    n = len(PROMPT)
    assert tree.parents == tuple(range(-1, n + 3))  # one chain through the draft nodes
    expected = sequential_reference(draft, PROMPT, 4)
    assert list(tree.tokens[n:]) == expected
    for i, token in enumerate(expected):
        prob = distribution(draft, PROMPT + expected[:i])[token].item()
        assert tree.draft_probs[n + i] == pytest.approx(prob, rel=1e-5)
    assert tree.draft_seconds >= 0
    # one forward over the committed chain, then one per draft node whose child is wanted
    assert tree.draft_rounds == (n, 1, 1, 1)


async def test_after_commits_the_chain_continues_the_committed_text(draft):
    """Partial acceptance, full acceptance (whose deepest node the drafter never ran), and a
    bonus token the draft did not predict: each next tree continues exactly the text."""
    wired = Wired(drafter(draft, "chain:4"))
    text = list(PROMPT)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            tree = await wired.draft(0, 4)
            n = tree.n_committed
            for step, n_accepted in enumerate([2, 4, 0, 1, 3], start=1):
                proposals = list(tree.tokens[n:])
                assert proposals == sequential_reference(draft, text, 4), f"step {step - 1}"
                accepted = tuple(range(n)) + tuple(range(n, n + n_accepted))
                text += proposals[:n_accepted]
                # a bonus the draft did not propose next, so the next tree must change
                rejected = proposals[n_accepted] if n_accepted < 4 else -1
                bonus = next(t for t in (7, 8) if t != rejected)
                await wired.commits.send(
                    Commit(step=step - 1, accepted=accepted, next_tokens=(bonus,))
                )
                text.append(bonus)
                tree = await wired.draft(step, 4)
                assert tree.step == step
                check_committed_chain(tree, [bonus])
                # the accepted node the drafter never ran rides in the bonus token's forward
                assert tree.draft_rounds[0] == (2 if n_accepted == 4 else 1)
                n = tree.n_committed
            assert list(tree.tokens[n:]) == sequential_reference(draft, text, 4)


def check_static_shape(tree: DraftTree, widths: tuple[int, ...]) -> None:
    """Every draft node at depth d < len(widths) below the chain has widths[d] children."""
    t = TokenTree(tree.tokens, tree.parents)
    level = [tree.n_committed - 1]
    for width in widths:
        children = [c for node in level for c in t.children(node)]
        for node in level:
            assert len(t.children(node)) == width
        level = children
    for node in level:
        assert t.children(node) == []
    draft_nodes = len(tree.tokens) - tree.n_committed
    assert draft_nodes == TreeSpec("static", widths).max_nodes


@pytest.mark.parametrize("widths", [(3, 2), (2, 2, 2), (4,), (1, 3)])
async def test_static_tree_takes_the_top_children_per_depth(draft, widths):
    spec = "static:" + ",".join(map(str, widths))
    wired = Wired(drafter(draft, spec))
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            tree = await wired.draft(0, TreeSpec.parse(spec).max_nodes)
    check_committed_chain(tree, PROMPT)
    check_static_shape(tree, widths)
    t = TokenTree(tree.tokens, tree.parents)
    for node in range(tree.n_committed - 1, len(t)):
        children = t.children(node)
        if not children:
            continue
        context = PROMPT + [t.tokens[p] for p in t.path_to(node)[tree.n_committed :]]
        probs = distribution(draft, context)
        top = torch.topk(probs, len(children))
        assert [t.tokens[c] for c in children] == top.indices.tolist()  # most likely first
        for child, p in zip(children, top.values.tolist(), strict=True):
            assert tree.draft_probs[child] == pytest.approx(p, rel=1e-5)
        # shadows: the best candidates that did not become children
        taken = {t.tokens[c] for c in children}
        best = torch.topk(probs, len(children) + 4).indices.tolist()
        assert list(tree.shadows[node]) == [tok for tok in best if tok not in taken][:4]
    assert len(tree.shadows) == len(t)
    for node in range(len(t)):
        if not t.children(node):
            assert tree.shadows[node] == ()  # never run: no distribution to draw from


async def test_static_tree_stops_at_the_requested_node_budget(draft):
    wired = Wired(drafter(draft, "static:3,2"))
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            tree = await wired.draft(0, 5)
    n = tree.n_committed
    assert len(tree.tokens) - n == 5
    # the three children of the last committed token, then two below the first of them
    assert tree.parents[n:] == (n - 1, n - 1, n - 1, n, n)


async def test_static_tree_after_a_commit_continues_the_accepted_branch(draft):
    wired = Wired(drafter(draft, "static:2,2"))
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            tree = await wired.draft(0, 6)
            n = tree.n_committed
            t = TokenTree(tree.tokens, tree.parents)
            # accept the second child of the chain end and its second child (a leaf the
            # drafter never ran): non-contiguous pending offsets must be compacted right
            second = t.children(n - 1)[1]
            leaf = t.children(second)[1]
            accepted = (*range(n), second, leaf)
            await wired.commits.send(Commit(step=0, accepted=accepted, next_tokens=(9,)))
            nxt = await wired.draft(1, 6)
    text = PROMPT + [t.tokens[second], t.tokens[leaf], 9]
    check_committed_chain(nxt, [9])
    check_static_shape(nxt, (2, 2))
    top = torch.topk(distribution(draft, text), 2).indices.tolist()
    assert [nxt.tokens[c] for c in TokenTree(nxt.tokens, nxt.parents).children(0)] == top


async def test_no_drafting_sends_the_committed_chain_alone():
    wired = Wired(drafter(None, "none"))
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            first = await wired.draft(0, 0)
            await wired.commits.send(
                Commit(step=0, accepted=tuple(range(len(PROMPT))), next_tokens=(42,))
            )
            second = await wired.draft(1, 0)
    check_committed_chain(first, PROMPT)
    assert len(first.tokens) == len(PROMPT)
    assert second.tokens == (42,) and second.n_committed == 1 and second.step == 1


async def test_closing_the_requests_ends_the_drafter_and_its_outbox(draft):
    wired = Wired(drafter(draft, "chain:2"))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(wired.drafter.run, wired.inbox, wired.outbox)
            async with wired.trees:
                async with wired.requests, wired.commits:
                    tree = await wired.draft(0, 2)
                    await wired.commits.send(
                        Commit(step=0, accepted=tuple(range(tree.n_committed)), next_tokens=(1,))
                    )
                    await wired.requests.aclose()  # idle, waiting for the next request
                    with pytest.raises(trio.EndOfChannel):
                        await wired.trees.receive()
        # the nursery exited: run() returned


async def test_closing_the_commits_while_waiting_for_one_ends_the_drafter(draft):
    wired = Wired(drafter(draft, "chain:2"))
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            await wired.draft(0, 2)
            await wired.commits.aclose()  # it is waiting for this step's commit
            with pytest.raises(trio.EndOfChannel):
                await wired.trees.receive()


async def test_an_error_in_the_draft_model_propagates_from_run(draft, monkeypatch):
    class DraftBroke(Exception):
        pass

    async def broken(self, request):
        raise DraftBroke(f"no tree for step {request.step}")

    monkeypatch.setattr(Drafter, "draft", broken)
    wired = Wired(drafter(draft, "chain:2"))
    with trio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(pytest.RaisesExc(DraftBroke, match="no tree for step 0")):
            async with wired.running():
                # the actor closes its outbox on the way out: our receive may end first
                with contextlib.suppress(trio.EndOfChannel):
                    await wired.draft(0, 2)


def gain_cost_drafter(model: Transformer, cost: CostModel, *, ahead: bool) -> Wired:
    """Its calibrator has seen the target follow the draft: rounds ahead would pay."""
    policy = DraftPolicy(TreeSpec.parse("gaincost"), cost, learned(0.9), ahead=ahead)
    units = (ComputeUnit("cpu"), ComputeUnit("npu"))
    cache = model.new_cache(len(PROMPT) + 128)
    return Wired(Drafter(model, policy, list(PROMPT), cache, units, Jitter(0, 0)))


def calls_of(monkeypatch, method: str) -> list[int]:
    """A list that grows by one at each call of a TreeBuilder method, which still runs."""
    calls: list[int] = []
    original = getattr(TreeBuilder, method)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TreeBuilder, method, counted)
    return calls


@pytest.mark.parametrize("flash_seconds, drafts_ahead", [(0.5, True), (0.0, False)])
async def test_drafting_ahead_only_beside_a_pass_that_flash_paces(
    draft, monkeypatch, flash_seconds, drafts_ahead
):
    """While the commit is awaited, draft rounds run below the sent tree only where the cost
    model says the pass waits on flash (cores idle); beside a compute-bound pass, none."""
    cost = CostModel(
        flash_bandwidth=1e9,
        streamed_bytes=int(flash_seconds * 1e9),
        verify=Curve([1, 128], [0.002, 0.256]),
        draft=Curve([1, 64], [0.01, 0.02]),
        project_seconds=1e-4,
        head_pass_seconds=0.0,
        contention=0.0,
    )
    wired = gain_cost_drafter(draft, cost, ahead=True)
    rounds = calls_of(monkeypatch, "run")
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            await wired.draft(0, 16)
            sent = len(rounds)
            with trio.move_on_after(1.0):  # the pass under verification
                while len(rounds) == sent:
                    await trio.sleep(0.01)
    assert (len(rounds) > sent) == drafts_ahead


async def test_the_commit_ends_the_round_drafted_ahead_in_flight(draft, monkeypatch):
    """The next tree waits for no more of a round ahead than the layer it is in: here a
    round whose layers would never end."""
    cost = CostModel(
        flash_bandwidth=1e9,
        streamed_bytes=int(0.5e9),  # a pass flash paces: rounds ahead may run
        verify=Curve([1, 128], [0.002, 0.256]),
        draft=Curve([1, 64], [0.01, 0.02]),
        project_seconds=1e-4,
        head_pass_seconds=0.0,
        contention=0.0,
    )
    original, in_flight, layers = TreeBuilder.run, threading.Event(), []

    def endless_ahead(self, nodes, pause=None):
        if pause is None:  # a round of the tree to send
            return original(self, nodes)
        in_flight.set()
        while len(layers) < 10 * TIMEOUT * 100:  # beyond the test's time
            pause()
            layers.append(1)
            time.sleep(0.001)
        return original(self, nodes, pause)

    monkeypatch.setattr(TreeBuilder, "run", endless_ahead)
    wired = gain_cost_drafter(draft, cost, ahead=True)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            first = await wired.draft(0, 16)
            await trio.to_thread.run_sync(in_flight.wait)
            accepted = tuple(range(first.n_committed))
            await wired.commits.send(Commit(step=0, accepted=accepted, next_tokens=(0,)))
            second = await wired.draft(1, 16)
    check_committed_chain(second, [0])


async def test_a_gain_cost_tree_carries_over_without_drafting_ahead(draft, monkeypatch):
    """The target's next token is a node the draft ran below the accepted path's end: the
    next tree starts from that node's subtree, with no forward to start it. The cache moves
    its entries on a unit: an op on the event loop's thread would start a second OpenMP
    team, and every team would then sleep after each product (device/units.py)."""
    cost = CostModel(  # a dear pass and cheap draft rounds: the tree grows deep
        flash_bandwidth=1e9,
        streamed_bytes=0,
        verify=Curve([1, 128], [1.0, 1.0]),
        draft=Curve([1, 64], [1e-4, 1e-4]),
        project_seconds=1e-6,
        head_pass_seconds=0.0,
    )
    wired = gain_cost_drafter(draft, cost, ahead=False)
    chains = calls_of(monkeypatch, "run_chain")
    with trio.fail_after(TIMEOUT), OpsOnThisThread() as ops:
        async with wired.running():
            first = await wired.draft(0, 16)
            # a draft node with children was run; accept the path down to its parent
            node = min(p for p in first.parents if p >= first.n_committed)
            path = [first.parents[node]]
            while path[-1] >= first.n_committed:
                path.append(first.parents[path[-1]])
            accepted = (*range(first.n_committed - 1), *reversed(path))
            below = [n for n, p in enumerate(first.parents) if p == node]
            await wired.commits.send(
                Commit(step=0, accepted=accepted, next_tokens=(first.tokens[node],))
            )
            second = await wired.draft(1, 16)
    assert len(chains) == 1  # the first tree's only
    assert ops.computed == []
    assert second.n_committed == 1 and second.tokens[0] == first.tokens[node]
    assert second.drafted_ahead >= len(below)
    assert {first.tokens[n] for n in below} <= {
        second.tokens[n] for n, p in enumerate(second.parents) if p == 0
    }


@pytest.mark.parametrize("draft_row, first", [(1.0, True), (1e-4, False)])
async def test_the_prompt_goes_alone_first_where_the_draft_runs_it_dearer_than_a_step(
    draft, draft_row, first
):
    """Where the draft's run of the prompt costs more than a one-token step, the first tree
    is the prompt alone (its first token comes without waiting for the draft), and the
    draft runs the prompt with the next tree, whose proposals continue the whole text."""
    cost = CostModel(
        flash_bandwidth=1e9,
        streamed_bytes=0,
        verify=Curve([1, 128], [0.05, 0.5]),
        draft=Curve([1, 64], [draft_row, 64 * draft_row]),
        project_seconds=0.01,
        head_pass_seconds=0.0,
    )
    wired = gain_cost_drafter(draft, cost, ahead=False)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            tree = await wired.draft(0, 4)
            check_committed_chain(tree, PROMPT)
            assert (len(tree.tokens) == len(PROMPT)) == first
            if first:
                assert tree.draft_rounds == ()
                accepted = tuple(range(len(PROMPT)))
                await wired.commits.send(Commit(step=0, accepted=accepted, next_tokens=(7,)))
                tree = await wired.draft(1, 4)
                check_committed_chain(tree, [7])
                assert tree.draft_rounds[0] == len(PROMPT) + 1  # the prompt, then the token
                greedy = sequential_reference(draft, [*PROMPT, 7], 1)
                children = TokenTree(tree.tokens, tree.parents).children(0)
                assert greedy[0] in [tree.tokens[c] for c in children]


async def test_a_prompt_beside_other_requests_is_not_sent_first(draft):
    cost = CostModel(
        flash_bandwidth=1e9,
        streamed_bytes=0,
        verify=Curve([1, 128], [0.05, 0.5]),
        draft=Curve([1, 64], [1.0, 64.0]),  # the draft's run of the prompt: dear
        project_seconds=0.01,
        head_pass_seconds=0.0,
    )
    wired = gain_cost_drafter(draft, cost, ahead=False)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            await wired.requests.send(DraftRequest(step=0, max_nodes=4, beside=Beside(1)))
            tree = await wired.trees.receive()
    check_committed_chain(tree, PROMPT)
    assert len(tree.tokens) > len(PROMPT)  # it drafted at once, as beside requests it did
