"""The verifier alone: seats, trees, layers, prune verdicts and commits in; slot releases,
exit probes and final hidden states out. Its final states equal a direct computation of the
target over each tree, with pruned nodes and their descendants left out, whatever other
requests' trees share the pass."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
import torch
import trio
from trio.testing import wait_all_tasks_blocked

import lever_actors.actors.verifier as verifier_module
from lever_actors.actors.jitter import Jitter
from lever_actors.actors.verifier import Verifier, VerifierInbox, VerifierOutbox
from lever_actors.channels.messages import (
    Commit,
    DraftTree,
    ExitProbe,
    FinalHidden,
    LayerWeights,
    LeaveSeat,
    PruneVerdict,
    SlotRelease,
    TakeSeat,
)
from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.device.budget import plan_residency
from lever_actors.device.manifest import read_manifest
from lever_actors.device.units import ComputeUnit
from lever_actors.model.placement import tree_placement
from lever_actors.model.transformer import Transformer
from lever_actors.model.tree import TokenTree
from lever_actors.model.weights import ModelWeights
from lever_actors.policy.pruning import always
from lever_actors.target import FlashTarget
from tests.tiny_hf import save_tiny, tiny_model

PROMPT = [3, 14, 15, 92, 65]
N_LAYERS = 4
EXIT = 1
TIMEOUT = 20
# below the committed prompt (nodes 0..4): 5 -> {6 -> {8, 9}, 7 -> {10}}
DRAFT_PARENTS = (4, 5, 5, 6, 6, 7)
DRAFT_TOKENS = (20, 21, 22, 23, 24, 25)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def layout(request, tmp_path_factory):
    hf = save_tiny(
        tiny_model(request.param, seed=2, layers=N_LAYERS), tmp_path_factory.mktemp("hf") / "m"
    )
    out = tmp_path_factory.mktemp("flash") / "layout"
    convert(hf, out, torch.float64)
    return out


@pytest.fixture
def target(layout):
    manifest = read_manifest(layout)
    target = FlashTarget(layout, plan_residency(manifest, manifest.file_bytes))
    yield target
    target.close()


@pytest.fixture(scope="module")
def reference(layout) -> Transformer:
    checkpoint = load_checkpoint(layout, torch.float64)
    return Transformer(checkpoint.args, checkpoint.weights)


def draft_tree(step: int, committed: list[int], parents=DRAFT_PARENTS, tokens=DRAFT_TOKENS):
    """The committed chain, then draft nodes whose parents are given relative to a
    five-token chain (node 4 = the last committed token)."""
    n = len(committed)
    shift = n - len(PROMPT)
    all_parents = tuple(range(-1, n - 1)) + tuple(p + shift for p in parents)
    all_tokens = tuple(committed) + tuple(tokens)
    return DraftTree(
        step=step,
        tokens=all_tokens,
        parents=all_parents,
        n_committed=n,
        draft_probs=(1.0,) * n + (0.5,) * len(tokens),
        draft_ranks=tuple(all_parents[:i].count(p) for i, p in enumerate(all_parents)),
        shadows=((),) * len(all_tokens),
        draft_seconds=0.0,
        draft_rounds=(),
    )


def direct(
    model: Transformer, context: list[int], tree: DraftTree, layers: int | None = None
) -> torch.Tensor:
    """The target's hidden states over the tree after `layers` layers (default all), the
    committed context first run as a chain in a fresh cache. -> [len(tree), d_model]"""
    if layers is not None:
        w = model.weights
        model = Transformer(
            model.args, ModelWeights(w.embed, w.final_norm, w.lm_head, w.layers[:layers])
        )
    t = TokenTree(tree.tokens, tree.parents)
    cache = model.new_cache(len(context) + len(t))
    if context:
        model.forward(torch.tensor(context), cache)
        cache.commit(len(context))
    place = tree_placement(model.rope, cache.length, t, model.dtype)
    return model.forward(torch.tensor(t.tokens), cache, place)


class SeatEnds:
    """One request's side of the batch: its cache, its commits' send end, its finals'
    receive end."""

    def __init__(self, seat: int, cache) -> None:
        self.cache = cache
        self.commits, commits = trio.open_memory_channel[Commit](1)
        finals, self.finals = trio.open_memory_channel[FinalHidden](1)
        self.take = TakeSeat(step=-1, seat=seat, cache=cache, commits=commits, finals=finals)


class Wired:
    """A verifier with channels we hold the other ends of. Layers are fed by hand from the
    target's resident weights, each tagged with a made-up ring slot to be released."""

    def __init__(
        self, target: FlashTarget, exit_layer: int | None = EXIT, audit_every=0, probe_when=always
    ):
        self.target = target
        self.verifier = Verifier(
            target, exit_layer, ComputeUnit("npu"), Jitter(0, 0), audit_every, probe_when
        )
        self.trees, arrivals = trio.open_memory_channel[DraftTree | TakeSeat | LeaveSeat](8)
        self.layers, layers = trio.open_memory_channel[LayerWeights](N_LAYERS)
        self.prune_verdicts, prune_verdicts = trio.open_memory_channel[PruneVerdict](1)
        releases, self.releases = trio.open_memory_channel[SlotRelease](N_LAYERS)
        probes, self.probes = trio.open_memory_channel[ExitProbe](1)
        self.inbox = VerifierInbox(arrivals, layers, prune_verdicts)
        self.released: list[SlotRelease] = []
        self.outbox = VerifierOutbox(releases, probes)
        self.seats: dict[int, SeatEnds] = {}

    def seat(self, seat: int = 0) -> SeatEnds:
        """A request's ends in the batch, and the TakeSeat that hands the verifier its own."""
        ends = self.seats[seat] = SeatEnds(seat, self.target.new_cache(64))
        return ends

    @property
    def commits(self) -> trio.MemorySendChannel[Commit]:
        return self.seats[0].commits

    @property
    def finals(self) -> trio.MemoryReceiveChannel[FinalHidden]:
        return self.seats[0].finals

    @contextlib.asynccontextmanager
    async def running(self, seats: int = 1):
        """The verifier started in a nursery with `seats` requests seated, our channel ends
        open; leaving closes them."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.verifier.run, self.inbox, self.outbox)
            async with contextlib.AsyncExitStack() as stack:
                for end in (self.trees, self.layers, self.prune_verdicts):
                    await stack.enter_async_context(end)
                for end in (self.releases, self.probes):
                    await stack.enter_async_context(end)
                for seat in range(seats):
                    await self.trees.send(self.seat(seat).take)
                yield nursery

    async def send_layers(self, step: int, slots: bool = True) -> None:
        for layer in range(N_LAYERS):
            await self.layers.send(
                LayerWeights(
                    step=step,
                    first=layer,
                    tensors=[self.target.resident_layers[layer]],
                    slot=(10 + layer) if slots else None,
                )
            )

    async def verify(self, tree: DraftTree, dropped=()) -> tuple[ExitProbe, FinalHidden]:
        """One step with a probe: send the tree and layers, answer the probe."""
        await self.trees.send(tree)
        await self.send_layers(tree.step)
        return await self.answered(tree, dropped)

    async def answered(self, tree: DraftTree, dropped=()) -> tuple[ExitProbe, FinalHidden]:
        """A step sent whole: answer its probe, take its final."""
        probe = await self.probes.receive()
        await self.prune_verdicts.send(PruneVerdict(step=tree.step, dropped=tuple(dropped)))
        final = await self.finals.receive()
        self.drain_releases()
        return probe, final

    def drain_releases(self) -> None:
        """Take the slot releases sent so far (each is sent before the step's final)."""
        while True:
            try:
                self.released.append(self.releases.receive_nowait())
            except trio.WouldBlock:
                return


async def test_final_hidden_equals_direct_computation(target, reference):
    wired = Wired(target)
    tree = draft_tree(0, PROMPT)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            probe, final = await wired.verify(tree)

    assert probe.step == 0 and probe.layer == EXIT and probe.tree == tree
    assert probe.nodes == tuple(range(len(tree.tokens)))
    torch.testing.assert_close(
        probe.hidden, direct(reference, [], tree, layers=EXIT + 1), rtol=1e-10, atol=1e-10
    )

    assert final.step == 0 and final.tree == tree
    assert final.nodes == tuple(range(len(tree.tokens)))
    assert final.hidden.dtype == torch.float64
    torch.testing.assert_close(final.hidden, direct(reference, [], tree), rtol=1e-10, atol=1e-10)
    assert final.pruned == 0 and final.saved_node_layers == 0
    assert final.io_wait_seconds >= 0 and final.verify_seconds > 0
    # every ring slot is handed back, in layer order, as soon as its layer is done
    assert wired.released == [SlotRelease(step=0, slot=10 + layer) for layer in range(N_LAYERS)]


async def test_layers_that_have_arrived_go_in_one_job_up_to_the_exit_layer(target, reference):
    wired = Wired(target)
    tree = draft_tree(0, PROMPT)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            await wired.send_layers(0, slots=False)  # resident, all queued before the tree
            await wired.trees.send(tree)
            probe = await wired.probes.receive()
            await wired.prune_verdicts.send(PruneVerdict(step=0, dropped=()))
            final = await wired.finals.receive()

    assert probe.layer == EXIT
    # the embedding with layers 0..EXIT; the rest
    assert wired.verifier.unit.jobs == 2
    torch.testing.assert_close(final.hidden, direct(reference, [], tree), rtol=1e-10, atol=1e-10)


async def test_a_run_of_resident_layers_is_split_at_the_exit_layer(target, reference):
    wired = Wired(target)
    tree = draft_tree(0, PROMPT)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            for step in (0, 1):  # each pass's layers in one message, the next one's queued too
                resident = [target.resident_layers[layer] for layer in range(N_LAYERS)]
                await wired.layers.send(
                    LayerWeights(step=step, first=0, tensors=resident, slot=None)
                )
            await wired.trees.send(tree)
            probe, final = await wired.answered(tree)
            assert wired.verifier.queued == []  # the pass took the rest of its run
    assert probe.layer == EXIT and wired.verifier.unit.jobs == 2  # up to the exit layer; the rest
    torch.testing.assert_close(final.hidden, direct(reference, [], tree), rtol=1e-10, atol=1e-10)


async def test_a_layer_in_a_ring_slot_goes_alone_so_the_other_slot_can_fill(target):
    wired = Wired(target)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            await wired.verify(draft_tree(0, PROMPT))  # every layer queued, each in a slot
    assert wired.verifier.unit.jobs == N_LAYERS  # each layer (the first embeds)


async def test_the_next_step_after_a_commit_sees_exactly_the_accepted_path(target, reference):
    wired = Wired(target)
    first = draft_tree(0, PROMPT)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            await wired.verify(first)
            # accept 5 -> 7 -> 10, skipping the sibling subtree at offsets 6, 8, 9
            accepted = (*range(len(PROMPT)), 5, 7, 10)
            await wired.commits.send(Commit(step=0, accepted=accepted, next_tokens=(33,)))
            second = draft_tree(1, [33], parents=(4, 4, 5), tokens=(40, 41, 42))
            _, final = await wired.verify(second)
            await wired.commits.send(
                Commit(step=1, accepted=(0, 1), next_tokens=(50,))
            )  # accept node 1 (token 40) below the bonus
            third = draft_tree(2, [50], parents=(4,), tokens=(60,))
            _, final3 = await wired.verify(third)

    context = PROMPT + [first.tokens[n] for n in accepted[len(PROMPT) :]]
    torch.testing.assert_close(
        final.hidden, direct(reference, context, second), rtol=1e-10, atol=1e-10
    )
    torch.testing.assert_close(
        final3.hidden, direct(reference, context + [33, 40], third), rtol=1e-10, atol=1e-10
    )


@pytest.mark.parametrize(
    ("dropped", "alive"),
    [
        pytest.param((6,), (0, 1, 2, 3, 4, 5, 7, 10), id="subtree"),
        pytest.param((8, 10), (0, 1, 2, 3, 4, 5, 6, 7, 9), id="leaves"),
        pytest.param((5,), (0, 1, 2, 3, 4), id="all-drafts"),
        pytest.param((0, 3, 9), (0, 1, 2, 3, 4, 5, 6, 7, 8, 10), id="committed-never-dropped"),
    ],
)
async def test_pruned_nodes_and_descendants_skip_the_remaining_layers(
    target, reference, dropped, alive
):
    wired = Wired(target)
    tree = draft_tree(0, PROMPT)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            _, final = await wired.verify(tree, dropped)
            # the KV cache of the survivors is right: continue with their path
            await wired.commits.send(
                Commit(step=0, accepted=(*range(len(PROMPT)), *alive[5:6]), next_tokens=(7,))
            )
            nxt = draft_tree(1, [7], parents=(4,), tokens=(8,))
            _, final2 = await wired.verify(nxt)
    assert final.nodes == alive
    expected = direct(reference, [], tree)[list(alive)]
    torch.testing.assert_close(final.hidden, expected, rtol=1e-10, atol=1e-10)
    n_pruned = len(tree.tokens) - len(alive)
    assert final.pruned == n_pruned
    assert final.saved_node_layers == n_pruned * (N_LAYERS - 1 - EXIT)
    context = PROMPT + [tree.tokens[n] for n in alive[5:6]]
    torch.testing.assert_close(
        final2.hidden, direct(reference, context, nxt), rtol=1e-10, atol=1e-10
    )


async def test_an_audit_step_runs_the_dropped_nodes_anyway(target, reference):
    wired = Wired(target, audit_every=1)
    tree = draft_tree(0, PROMPT)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            _, final = await wired.verify(tree, dropped=(6,))
    assert final.audit
    assert final.would_drop == (6, 8, 9)
    assert final.nodes == tuple(range(len(tree.tokens)))
    torch.testing.assert_close(final.hidden, direct(reference, [], tree), rtol=1e-10, atol=1e-10)


async def test_no_probe_without_draft_nodes_an_exit_layer_or_the_policys_leave(target, reference):
    chain_only, drafted = draft_tree(0, PROMPT, parents=(), tokens=()), draft_tree(0, PROMPT)
    asked = []

    def io_bound(nodes: int) -> bool:  # as when_compute_bound answers for an I/O-bound pass
        asked.append(nodes)
        return False

    for exit_layer, tree, probe_when in [
        (EXIT, chain_only, always),
        (None, drafted, always),
        (EXIT, drafted, io_bound),
    ]:
        wired = Wired(target, exit_layer=exit_layer, probe_when=probe_when)
        with trio.fail_after(TIMEOUT):
            async with wired.running():
                await wired.trees.send(tree)
                await wired.send_layers(0, slots=False)
                final = await wired.finals.receive()
                with pytest.raises(trio.WouldBlock):
                    wired.probes.receive_nowait()
                with pytest.raises(trio.WouldBlock):  # resident layers: nothing to release
                    wired.releases.receive_nowait()
        assert final.nodes == tuple(range(len(tree.tokens)))
        torch.testing.assert_close(
            final.hidden, direct(reference, [], tree), rtol=1e-10, atol=1e-10
        )
    assert asked == [len(drafted.tokens)]  # asked once, at the exit layer


@pytest.mark.parametrize(("step", "layer"), [(1, 0), (0, 1)])
async def test_a_layer_out_of_order_is_an_error(target, step, layer):
    wired = Wired(target)
    with trio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(
            pytest.RaisesExc(RuntimeError, match=r"expected layer 0 of pass 0")
        ):
            async with wired.running():
                await wired.trees.send(draft_tree(0, PROMPT))
                await wired.layers.send(
                    LayerWeights(
                        step=step,
                        first=layer,
                        tensors=[target.resident_layers[layer]],
                        slot=None,
                    )
                )
                with contextlib.suppress(trio.EndOfChannel):
                    await wired.finals.receive()


async def test_closing_the_arrivals_ends_the_verifier_and_its_outboxes(target):
    wired = Wired(target)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            await wired.verify(draft_tree(0, PROMPT))
            await wired.trees.aclose()
            for outbox in (wired.releases, wired.probes):
                with pytest.raises(trio.EndOfChannel):
                    await outbox.receive()


@pytest.mark.parametrize("committed", [True, False])
async def test_a_request_leaving_has_its_last_path_kept_then_its_ends_closed(target, committed):
    wired = Wired(target)
    accepted = (*range(len(PROMPT)), 5, 7)
    with trio.fail_after(TIMEOUT):
        async with wired.running():
            await wired.verify(draft_tree(0, PROMPT))
            if committed:
                await wired.commits.send(Commit(step=0, accepted=accepted, next_tokens=(1,)))
            await wired.commits.aclose()  # the step loop's end, before it leaves
            leave = LeaveSeat(step=-1, seat=0, done=trio.Event())
            await wired.trees.send(leave)
            await leave.done.wait()
            with pytest.raises(trio.EndOfChannel):
                await wired.finals.receive()
    # the cache holds the accepted path, ready for the prefix cache; nothing without a commit
    assert wired.seats[0].cache.length == (len(accepted) if committed else 0)


async def test_trees_of_several_requests_share_each_layer_and_each_gets_its_own(target, reference):
    wired = Wired(target)
    first = draft_tree(0, PROMPT)
    other = [9, 8, 7]
    second = draft_tree(0, other, parents=(2, 3), tokens=(30, 31))
    with trio.fail_after(TIMEOUT):
        async with wired.running(seats=2):
            await wired.trees.send(first)
            await wired.trees.send(msgspec.structs.replace(second, seat=1))
            await wired.send_layers(0)  # one pass: each layer once, for both
            probes = []
            for _ in range(2):  # each tree's probe in turn
                probes.append(await wired.probes.receive())
                await wired.prune_verdicts.send(PruneVerdict(step=0, dropped=()))
            finals = [await wired.seats[s].finals.receive() for s in (0, 1)]
            wired.drain_releases()
    assert [p.tree.seat for p in probes] == [0, 1]
    for final, tree in zip(finals, (first, second), strict=True):
        torch.testing.assert_close(
            final.hidden, direct(reference, [], tree), rtol=1e-10, atol=1e-10
        )
        assert (final.pass_rows, final.parallel) == (len(first.tokens) + 5, 2)
    assert wired.released == [SlotRelease(step=0, slot=10 + layer) for layer in range(N_LAYERS)]
    assert wired.verifier.unit.jobs == N_LAYERS  # the two trees in each layer's one job


async def test_a_pass_waits_for_every_seated_request_but_not_one_that_left(target, reference):
    wired = Wired(target, exit_layer=None)
    tree = draft_tree(0, PROMPT)
    with trio.fail_after(TIMEOUT):
        async with wired.running(seats=2):
            await wired.trees.send(tree)
            await wired.send_layers(0, slots=False)
            await wait_all_tasks_blocked()
            # seat 1 has sent no tree yet: the pass has not started, no layer is taken
            assert wired.layers.statistics().current_buffer_used == N_LAYERS
            await wired.seats[1].commits.aclose()
            leave = LeaveSeat(step=-1, seat=1, done=trio.Event())
            await wired.trees.send(leave)
            final = await wired.finals.receive()
            await leave.done.wait()
    assert final.parallel == 1
    torch.testing.assert_close(final.hidden, direct(reference, [], tree), rtol=1e-10, atol=1e-10)


async def test_an_error_survives_a_peer_failing_while_the_verifier_closes(target, monkeypatch):
    """In the engine the step loop fails (EndOfChannel) as soon as the pipeline's channels
    close under it, and the nursery then cancels everyone. The verifier's own error must
    still reach the nursery, not be replaced by that Cancelled while its ends close."""

    class LayerBroke(Exception):
        pass

    class PeerSawTheEnd(Exception):
        pass

    def broken(*args):
        raise LayerBroke("layer 0 broke")

    monkeypatch.setattr(verifier_module, "batch_layers_forward", broken)
    wired = Wired(target)

    async def peer():  # stands for the projector and the engine behind it
        try:
            await wired.finals.receive()
        except trio.EndOfChannel:
            raise PeerSawTheEnd from None

    with trio.fail_after(TIMEOUT):
        with pytest.raises(BaseExceptionGroup) as raised:
            async with wired.running() as nursery:
                nursery.start_soon(peer)
                await wired.trees.send(draft_tree(0, PROMPT))
                await wired.send_layers(0)
                await trio.sleep_forever()
    assert raised.value.subgroup(LayerBroke) is not None, f"the error was lost: {raised.value!r}"
