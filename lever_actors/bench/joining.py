"""A prompt joining requests already decoding (`bench --parallel`, ours with N > 1): the
longest prompt of the mixed sets comes while the first N-1 prompts of the first round are
some tokens into their answers, on the same engine. Its time to first token against its
time alone, and the running requests' longest gap between steps while it comes in against
their step before it.

Every prompt has been decoded by then, and the engine keeps finished requests' KV for
those that begin the same: the joining prompt goes without its first token alone, and
without its first two beside the others, so that neither starts as any earlier text did;
the running prompts go without their first token too, so that they prefill as they did in
the round whose stamps time the join (reusing their KV, they would be further in, or done,
when it came)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from lever_actors.bench.results import Joining
from lever_actors.bench.together import DecodesTogether, Together
from lever_actors.model.sampling import Sampling

JOIN_AFTER_TOKENS = 16  # how far into their answers the running requests are when it comes
STEPS_BEFORE = 8  # their step: the median of their gaps over this many steps before it came
SAME_STEP_SECONDS = 1e-4  # tokens this close came with one step


async def run_joining(
    mode: DecodesTogether,
    running: Sequence[list[int]],
    first_round: Together,
    joining: list[int],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    sampling: Sampling,
) -> tuple[float, Together]:
    """`joining` alone, then beside `running` (the first round's first prompts, the round
    `first_round` timed) once they are JOIN_AFTER_TOKENS into their answers; its first
    token's time alone, and the second run."""
    alone = await mode.decode_together([joining[1:]], 1, stop_ids, sampling)
    delay = join_delay(first_round, len(running))
    fresh = [prompt[1:] for prompt in running]
    busy = await mode.decode_together(
        [*fresh, joining[2:]], max_new_tokens, stop_ids, sampling, [0.0] * len(running) + [delay]
    )
    return first_token_seconds(alone, 0), busy


def join_delay(first_round: Together, running: int) -> float:
    """When the first `running` requests of a round had each given JOIN_AFTER_TOKENS tokens
    (or ended), from the round's start."""
    start = min(first_round.started)
    return max(
        (d.stamps[JOIN_AFTER_TOKENS - 1] if len(d.stamps) >= JOIN_AFTER_TOKENS else ended) - start
        for d, ended in zip(first_round.decoded[:running], first_round.ended, strict=False)
    )


def first_token_seconds(together: Together, index: int) -> float:
    decoded = together.decoded[index]
    end = decoded.stamps[0] if decoded.stamps else together.ended[index]
    return end - together.started[index]


def joining_figures(
    prompt_set: str, prompt_index: int, prompt_tokens: int, alone_s: float, busy: Together
) -> Joining:
    """The figures of a run of `run_joining`: the joining prompt is the last of `busy`."""
    last = len(busy.decoded) - 1
    came = busy.started[last]
    first = came + first_token_seconds(busy, last)
    before: list[float] = []
    during: list[float] = []
    for decoded in busy.decoded[:last]:
        steps = step_times(decoded.stamps, decoded.token_steps)
        gaps = list(zip(steps, steps[1:], strict=False))
        before += [b - a for a, b in gaps if b <= came][-STEPS_BEFORE:]
        during += [b - a for a, b in gaps if b > came and a < first]
    return Joining(
        prompt_set=prompt_set,
        prompt_index=prompt_index,
        prompt_tokens=prompt_tokens,
        first_token_alone_s=alone_s,
        first_token_busy_s=first - came,
        running=last,
        step_s=statistics.median(before) if before else 0.0,
        gap_s=max(during, default=None),  # None: none of them stepped while it came
    )


def step_times(stamps: Sequence[float], token_steps: Sequence[int] = ()) -> list[float]:
    """When each step's tokens came: the first stamp of each step, by the step each token
    names where the mode tells (a step's tokens may reach the reader further apart than
    SAME_STEP_SECONDS on a busy loop), else of each run of stamps that came together."""
    if token_steps:
        return [t for i, t in enumerate(stamps) if i == 0 or token_steps[i] != token_steps[i - 1]]
    times: list[float] = []
    for stamp in stamps:
        if not times or stamp - times[-1] > SAME_STEP_SECONDS:
            times.append(stamp)
    return times
