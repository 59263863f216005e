"""Every message that crosses a channel between actors. Tensors ride in-process only;
the trace codec (channels/trace.py) summarises them when messages are written out."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import msgspec


class Message(msgspec.Struct, frozen=True, tag=True):
    """Shared tagged base: the tag names the type in traces."""

    step: int  # the decoding step this message belongs to (-1 when it has none)


class Beside(NamedTuple):
    """The other requests in a pass, as of their last steps: how many, their tree nodes,
    and the tokens those gave."""

    requests: int = 0
    rows: int = 0
    tokens: float = 0.0


ALONE = Beside()


class DraftRequest(Message, frozen=True):
    """engine -> drafter: build the tree for this step from the committed context."""

    max_nodes: int  # hard cap on draft nodes (not counting the committed chain)
    # the other requests in the pass (a tree is sized for the pass's rows and all its
    # requests' tokens)
    beside: Beside = ALONE


class DraftTree(Message, frozen=True):
    """drafter -> verifier: committed tokens not yet in the target's cache, then draft nodes.

    Nodes [0, n_committed) are a chain of committed tokens; the rest are proposals.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    n_committed: int
    draft_probs: tuple[float, ...]  # per node: draft probability of its token (1.0 when committed)
    draft_ranks: tuple[int, ...]  # per node: its place among its parent's candidates (0: first)
    shadows: tuple[tuple[int, ...], ...]  # per node: best untaken candidates (empty if not run)
    draft_seconds: float
    draft_rounds: tuple[int, ...]  # nodes in each draft forward
    drafted_ahead: int = 0  # draft nodes carried from the previous tree (run before the commit)
    seat: int = 0  # the request's place in the verifier's batch (TakeSeat)


class TakeSeat(Message, frozen=True):
    """engine -> verifier: a request joins the batch; its trees, tagged with `seat`, are
    verified with the others' from the next pass on. The verifier owns the ends given."""

    seat: int
    cache: Any  # KVCache: the target's, for the request's text
    commits: Any  # trio.MemoryReceiveChannel[Commit]: the request's, from the engine
    finals: Any  # trio.MemorySendChannel[FinalHidden]: to the request's projector
    progress: Any = None  # Progress | None: hears of a long prefill's layers


class DraftRound(Message, frozen=True):
    """drafter -> verifier: run this draft forward (a policy.trees.Round) with those of the
    other requests still drafting, in one job; then `done` (a trio.Event) is set, and the
    round holds its error if it failed."""

    seat: int
    round: Any
    done: Any


class LeaveSeat(Message, frozen=True):
    """engine -> verifier: the request has ended; its last commit is kept in its cache
    (if it sent one), its ends closed, then `done` (a trio.Event) is set."""

    seat: int
    done: Any


class StepAside(Message, frozen=True):
    """engine -> verifier: the request waits for its consumer to take its tokens; passes go
    on without it until its next tree comes (its KV and its place kept)."""

    seat: int


class LayerWeights(Message, frozen=True):
    """prefetcher -> verifier: layers `first`, `first` + 1, ... of pass `step`: one streamed
    layer in a ring slot, or a run of resident layers in one message (a message a layer
    held the event loop, and with it the unit's next job, ~1.3 ms a resident pass)."""

    first: int
    tensors: list[dict[str, Any]]  # per layer, in order; a slot's valid until it is released
    slot: int | None  # None for resident layers, which need no release

    @property
    def layers(self) -> range:
        return range(self.first, self.first + len(self.tensors))


class SlotRelease(Message, frozen=True):
    """verifier -> prefetcher: the layer in this ring slot is done; the slot may be refilled."""

    slot: int


class ExitProbe(Message, frozen=True):
    """verifier -> pruner: hidden states of the live nodes at the exit layer."""

    tree: DraftTree
    layer: int
    nodes: tuple[int, ...]  # live node indices, in order
    hidden: Any  # torch.Tensor [len(nodes), d_model]


class PruneVerdict(Message, frozen=True):
    """pruner -> verifier: nodes to drop; their descendants are dropped with them."""

    dropped: tuple[int, ...]


class FinalHidden(Message, frozen=True):
    """verifier -> projector: last-layer hidden states of the nodes that survived pruning."""

    tree: DraftTree
    position: int  # absolute position of the tree's first node: the target's context length
    nodes: tuple[int, ...]  # live node indices, in order
    hidden: Any  # torch.Tensor [len(nodes), d_model]
    io_wait_seconds: float
    verify_seconds: float  # the pass's layers' compute: its jobs' own time, not their waits
    project_seconds: float  # the pass's projection of the predicted chains (0: none)
    pruned: int  # nodes that skipped the layers after the exit layer
    saved_node_layers: int  # node-layer computations pruning saved
    probe_seconds: float  # the pruner's round trip at the exit layer (0: no probe)
    audit: bool  # an audit step: the pruner's drops were run in full anyway
    would_drop: tuple[int, ...]  # on an audit step: the nodes the pruner dropped
    pass_rows: int = 0  # every request's tree nodes in the pass
    parallel: int = 1  # requests whose trees the pass verified
    passes: int = 1  # the passes the tree took: more where its prompt came in chunks
    # node -> its logits [vocab], for the predicted chain from the last committed node
    # (the drafter's first-ranked live children), where the pass projected it
    logits: dict[int, Any] = {}


class StepStats(msgspec.Struct, frozen=True):
    """projector -> engine (in the Verdict) -> cost model and user: what one step cost and
    achieved. The engine adds what only it sees: tokens emitted and the whole step's time."""

    step: int
    tree_nodes: int
    live_nodes: int  # after pruning
    pruned: int  # nodes that skipped the layers after the exit layer
    saved_node_layers: int  # node-layer computations pruning saved
    probe_seconds: float  # the pruner's round trip at the exit layer (0: no probe)
    audited: bool  # this step checked the pruner: its drops were run in full anyway
    false_prunes: int  # on an audit step: accepted nodes the pruner would have dropped
    projected_nodes: int
    drafted_ahead: int  # tree nodes carried from the previous step's tree (run before its commit)
    draft_rounds: tuple[int, ...]  # nodes in each draft forward
    draft_seconds: float
    io_wait_seconds: float
    verify_seconds: float  # the pass's layers' compute: its jobs' own time, not their waits
    project_seconds: float  # the LM head's: the pass's chains and the walk's
    new_tokens: int = 0  # emitted to the user: accepted draft tokens + the bonus token
    step_seconds: float = 0.0  # request for the tree to the last token emitted
    bytes_read: int = 0  # from flash during the step, by every reader
    read_seconds: float = 0.0  # those reads' own time (summed over the threads reading)
    copied: int = 0  # tree nodes copied from the committed text, not drafted (policy/lookup.py)
    pass_rows: int = 0  # every request's tree nodes in the pass (0: this tree's alone)
    parallel: int = 1  # requests whose trees the pass verified
    passes: int = 1  # the passes the tree took: more where its prompt came in chunks


class Verdict(Message, frozen=True):
    """projector -> engine: the accepted path, the target's own next token, the step's figures."""

    accepted: tuple[int, ...]  # node indices along the path, committed chain first
    tokens: tuple[int, ...]  # new tokens: accepted draft tokens, then the bonus token
    from_draft: tuple[bool, ...]  # per new token: was it proposed by the drafter
    logprobs: tuple[float, ...]  # per new token: the target's log-probability of it
    stats: StepStats
    # per new token, where the request asks: its position's most likely (token, logprob)
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


# how a drafter proposes after a commit: as before; copies of the text, keeping the draft
# model (a trial); the draft's trees again; copies for good, the draft let go
Then = Literal["same", "try_copies", "trees", "copies"]


class Commit(Message, frozen=True):
    """engine -> verifier, drafter: keep these tree nodes in the KV caches; `tokens` follow."""

    accepted: tuple[int, ...]  # node indices of the step's tree to keep, in order
    next_tokens: tuple[int, ...]  # committed tokens not in any cache yet (the bonus token)
    # how the drafter proposes from the next step on (plan/switch.py)
    then: Then = "same"


FinishReason = Literal["stop", "length"]


class TopLogprob(msgspec.Struct, frozen=True):
    """One of a position's likeliest tokens: its id, its text there, the target's
    log-probability of it."""

    token: int
    text: str
    logprob: float


class TokenEvent(msgspec.Struct, frozen=True):
    """engine -> user: one generated token, with the request's running totals."""

    token: int
    text: str  # the text this token completes (may be empty mid-character; never special tokens)
    step: int
    from_draft: bool
    logprob: float  # the target's log-probability of this token (before temperature, filters)
    prompt_tokens: int
    cached_tokens: int  # of the prompt's, those whose KV an earlier request left
    generated_tokens: int  # so far, this one included
    elapsed_seconds: float  # since the request started
    tokens_per_second: float | None  # decode rate so far after the first step; None during it
    finish_reason: FinishReason | None = None  # on the last token: "stop" or "length"
    piece: str = ""  # the token's own text in context (stop strings aside; "" if special)
    # where the request asks (top_logprobs): its position's likeliest tokens
    top_logprobs: tuple[TopLogprob, ...] = ()
    parallel: int = 1  # requests whose trees the pass that verified this token took
