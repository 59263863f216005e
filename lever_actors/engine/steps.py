"""The engine's own loop over a request's steps: ask the drafter for a tree, take the
projector's verdict, emit its tokens as events, commit the accepted path to both caches.

A token becomes an event in `Emitter`: its text (what may begin a stop string held back
until it cannot), its piece, its alternatives and whether it ends the request."""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
import trio

from lever_actors.actors.verifier import Arrival
from lever_actors.channels.messages import (
    Beside,
    Commit,
    DraftRequest,
    FinishReason,
    StepAside,
    TokenEvent,
    TopLogprob,
    Verdict,
)
from lever_actors.channels.stats import DecodePhase
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.device.memory import return_freed_heap
from lever_actors.engine.batch import Batch, Place
from lever_actors.engine.state import RequestState
from lever_actors.engine.switching import PlanSwitch
from lever_actors.errors import ConsumerStalledError
from lever_actors.policy.setup import Policies
from lever_actors.target import FlashTarget
from lever_actors.text.finish import finish_reason
from lever_actors.text.stop import StopText


async def run_steps(
    request: RequestState,
    place: Place,
    batch: Batch,
    events: trio.MemorySendChannel[TokenEvent],
    arrivals: trio.MemorySendChannel[Arrival],
    requests: Any,  # send ends: trio's, or tracing wrappers with the same methods
    verdicts: trio.MemoryReceiveChannel[Verdict],
    commits: tuple[Any, ...],  # to the drafter and the verifier
    target: FlashTarget,
    policies: Policies,
    switch: PlanSwitch,
    drafting: bool,
    stall_seconds: float | None,
) -> None:
    """Ask for a tree (sized for the requests beside it in the batch), take the verdict,
    emit, commit; until the request ends. Where its consumer is not taking the events, the
    request steps aside (`arrivals`: the verifier's), so that the others' passes go on.
    `drafting`: the request's drafter proposes with the draft model, until `switch` says to
    copy from the text instead (or to try it)."""
    emitter = Emitter(request, target.tokenizer)
    follower = switch.follower(drafting)
    reads = target.store.stats
    for step in range(request.options.max_new_tokens):
        step_started = time.perf_counter()
        bytes_before, read_seconds_before = reads.bytes_read, reads.read_seconds
        await requests.send(
            DraftRequest(
                step=step,
                max_nodes=min(policies.spec.max_nodes, request.tree_nodes),
                beside=batch.beside(place),
            )
        )
        verdict: Verdict = await verdicts.receive()
        request.scope.deadline = math.inf  # from the first token on, the deadline is soft
        finish: FinishReason | None = None
        emitted = 0
        aside = False  # waiting for the consumer, out of the passes
        consumer_seconds = 0.0  # no part of the step's cost
        last = len(verdict.tokens)
        tops = verdict.top_logprobs or ((),) * last
        for token, from_draft, logprob, top in zip(
            verdict.tokens, verdict.from_draft, verdict.logprobs, tops, strict=True
        ):
            emitted += 1
            event = emitter.event(
                step, token, from_draft, logprob, top, emitted == last, verdict.stats.parallel
            )
            finish = event.finish_reason
            try:
                if aside or not _sent_at_once(events, event):
                    waiting = time.perf_counter()
                    if not aside:  # the others' passes go on without it meanwhile
                        aside = True
                        await arrivals.send(StepAside(step=step, seat=place.seat))
                    with trio.fail_after(stall_seconds or math.inf):
                        await events.send(event)
                    consumer_seconds += time.perf_counter() - waiting
            except trio.BrokenResourceError:
                return  # the consumer stopped listening: the request ends here
            except trio.TooSlowError:
                raise ConsumerStalledError(
                    f"no token was taken for {stall_seconds:g} s: the request "
                    "was ended, so that the others could run"
                ) from None
            if finish is not None:
                break
        stats = msgspec.structs.replace(
            verdict.stats,
            new_tokens=emitted,
            step_seconds=time.perf_counter() - step_started - consumer_seconds,
            bytes_read=reads.bytes_read - bytes_before,
            read_seconds=reads.read_seconds - read_seconds_before,
        )
        request.steps.append(stats)
        place.last = Beside(0, _rows_from_now_on(verdict), emitted)
        if policies.cost is not None:
            policies.cost.observe(stats)
        then = follower.after_step(request.steps, request.prompt, request.tokens)
        switch.after_any_step()
        commit = Commit(
            step=step, accepted=verdict.accepted, next_tokens=verdict.tokens[-1:], then=then
        )
        for channel in commits:  # the last step's too: both caches keep its path
            await channel.send(commit)
        if finish is not None:
            return
        if target.plan.streams:
            # the step's freed temporaries (~150 MB held at steady state) back to the
            # kernel: short of memory they would crowd out the page cache. About a
            # millisecond on the event loop, 2% of a resident step, so only then.
            return_freed_heap()


def _sent_at_once(events: trio.MemorySendChannel[TokenEvent], event: TokenEvent) -> bool:
    """Whether the consumer's buffer took `event` without a wait."""
    try:
        events.send_nowait(event)
    except trio.WouldBlock:
        return False
    return True


class Emitter:
    """Turns one request's tokens, in order, into its TokenEvents."""

    def __init__(self, request: RequestState, tokenizer: Tokenizer | None) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.decoder = (
            tokenizer.stream_decoder(skip_special=True, context=request.prompt[-1:])
            if tokenizer
            else None
        )
        self.stop_ids = tokenizer.eos_ids if tokenizer else frozenset()
        self.previous = request.prompt[-1]  # the token a piece of text follows
        self.stops = StopText(request.options.stop, keep=request.options.keep_stop)
        self.phase = DecodePhase()

    def event(
        self,
        step: int,
        token: int,
        from_draft: bool,
        logprob: float,
        top: tuple[tuple[int, float], ...],
        last_of_step: bool,
        parallel: int = 1,
    ) -> TokenEvent:
        """The event of the request's next token; its finish_reason says when it is the
        last (an end token, a stop string, max_new_tokens, or past the deadline at the
        step's last token)."""
        request, tokenizer, decoder, stops = self.request, self.tokenizer, self.decoder, self.stops
        request.tokens.append(token)
        delta, stopped = stops.push(decoder.push(token) if decoder else "")
        piece = tokenizer.piece(token, self.previous) if tokenizer else ""
        alternatives = tuple(
            TopLogprob(t, tokenizer.piece(t, self.previous) if tokenizer else "", lp)
            for t, lp in top
        )
        self.previous = token
        finish = finish_reason(
            end_token=token in self.stop_ids,
            stop_string=stopped,
            generated=len(request.tokens),
            max_new_tokens=request.options.max_new_tokens,
            # past the deadline, the step's tokens are all out; no step after it
            cut_short=last_of_step and request.past_deadline,
        )
        if finish is not None and not stopped:  # what is still held back ends here
            more, cut = stops.push(decoder.flush() if decoder else "")
            delta += more if cut else more + stops.flush()
        elapsed = time.perf_counter() - request.created
        self.phase.add(step, elapsed)
        return TokenEvent(
            token=token,
            text=delta,
            step=step,
            from_draft=from_draft,
            logprob=logprob,
            prompt_tokens=len(request.prompt),
            cached_tokens=request.reuse.tokens,
            generated_tokens=len(request.tokens),
            elapsed_seconds=elapsed,
            tokens_per_second=self.phase.rate,
            finish_reason=finish,
            piece=piece,
            top_logprobs=alternatives,
            parallel=parallel,
        )


def _rows_from_now_on(verdict: Verdict) -> int:
    """The rows of the step's tree as its next passes will have them, below a one-token
    chain: a prompt's rows come once (counted beside the others' next trees, they made
    any node of theirs look cheap)."""
    chain = len(verdict.accepted) - sum(verdict.from_draft)
    return verdict.stats.tree_nodes - chain + 1
