"""What a request asks for beside its prompt: how many tokens, where to stop, how to choose
them. Built and checked once, by the CLI, the server or `Engine.stream`'s keywords, and
passed whole to the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict, Unpack

import msgspec

from lever_actors.config import DEFAULT_MAX_NEW_TOKENS, check_max_new_tokens
from lever_actors.errors import ConfigError
from lever_actors.logs import get_logger
from lever_actors.model.grammar import Grammar
from lever_actors.model.sampling import GREEDY, Sampling, seed_or_drawn

log = get_logger(__name__)

MAX_TOP_LOGPROBS = 20  # as OpenAI's
# OpenAI takes 4; each string is looked for after every token, so thousands slowed a
# request and those beside it in the batch (100,000: 8x)
MAX_STOP_STRINGS = 64


class GenerationOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Generation ends (text/finish.py) after `max_new_tokens` ("length"), after one of the
    tokenizer's end tokens (`eos_ids`: end of text, end of turn; "stop", its text not
    emitted), or after the token that completes one of the `stop` strings ("stop"; the text
    ends where the string begins, as OpenAI's does, or with `keep_stop` after that token,
    the string in it; text that may begin one is held back until it cannot).

    `deadline_seconds`, counted from the request's making (its wait for the engine
    included): the step that ends after it is the last ("length", its text cut short); a
    request still waiting or in its prefill then is cancelled (DeadlineError).

    `sampling` (model/sampling.py): temperature 0 is greedy decoding; above 0 tokens are
    sampled from the target's softmax at that temperature, after top-k, top-p and min-p
    filtering, and the output equals sequential sampling with the same seed, whatever the
    tree. Given as keywords without a seed, one is drawn, logged, and reported
    (`GenerationResult.seed`).

    `grammar` constrains the text (model/grammar.py: a JSON schema, any JSON, a regex or a
    Lark grammar): each token is chosen among those it allows, exactly as sequential
    decoding under it would, and once it is complete only an end token is."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: Sequence[str] = ()  # kept as a tuple
    keep_stop: bool = False
    sampling: Sampling = GREEDY
    deadline_seconds: float | None = None  # None: none
    # each token's likeliest alternatives to report, with their log-probabilities (0-20)
    top_logprobs: int = 0
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        check_max_new_tokens(self.max_new_tokens)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError(
                f"top_logprobs = {self.top_logprobs}: expected 0 to {MAX_TOP_LOGPROBS}"
            )
        if self.deadline_seconds is not None and not self.deadline_seconds > 0:  # NaN too
            raise ConfigError(f"deadline_seconds = {self.deadline_seconds!r}: expected > 0")
        if isinstance(self.stop, str):
            raise ConfigError("stop must be a list of strings, not one string")
        if not all(isinstance(s, str) for s in self.stop):
            raise ConfigError("stop must be a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ConfigError(
                f"stop has {len(self.stop):,} strings: expected {MAX_STOP_STRINGS} at most"
            )
        if "" in self.stop:  # every text contains it: each generation would end at once
            raise ConfigError(f"stop = {list(self.stop)!r}: expected no empty string")
        msgspec.structs.force_setattr(self, "stop", tuple(self.stop))

    def choice(self, index: int) -> GenerationOptions:
        """The options of a request's choice `index` (OpenAI's `n`): its seed the request's
        plus `index` (modulo 2**64), so that choice 0 is the request alone and each choice
        is the same whenever the request is."""
        seed = (self.sampling.seed + index) % 2**64
        return msgspec.structs.replace(
            self, sampling=msgspec.structs.replace(self.sampling, seed=seed)
        )


DEFAULTS = GenerationOptions()


class GenerationKeywords(TypedDict, total=False):
    """`GenerationOptions` spelled flat, as `Engine.stream` takes it; what is left out takes
    the options' default."""

    max_new_tokens: int
    stop: Sequence[str]
    keep_stop: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None  # None: drawn where sampling needs one, and logged
    deadline_seconds: float | None
    top_logprobs: int
    grammar: Grammar | None


def options_of(
    options: GenerationOptions | None, keywords: GenerationKeywords
) -> GenerationOptions:
    """`options` as given, or the options its keywords spell out; not both."""
    if options is not None:
        if keywords:
            raise ConfigError(f"give options or {', '.join(keywords)}, not both")
        return options
    unknown = set(keywords) - set(GenerationKeywords.__annotations__)
    if unknown:  # a TypedDict checks its keys only for a type checker
        raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(unknown))}")
    sampling = seeded_sampling(
        temperature=keywords.get("temperature", GREEDY.temperature),
        top_k=keywords.get("top_k", GREEDY.top_k),
        top_p=keywords.get("top_p", GREEDY.top_p),
        min_p=keywords.get("min_p", GREEDY.min_p),
        seed=keywords.get("seed"),
    )
    return GenerationOptions(
        max_new_tokens=keywords.get("max_new_tokens", DEFAULTS.max_new_tokens),
        stop=keywords.get("stop", DEFAULTS.stop),
        keep_stop=keywords.get("keep_stop", DEFAULTS.keep_stop),
        sampling=sampling,
        deadline_seconds=keywords.get("deadline_seconds", DEFAULTS.deadline_seconds),
        top_logprobs=keywords.get("top_logprobs", DEFAULTS.top_logprobs),
        grammar=keywords.get("grammar", DEFAULTS.grammar),
    )


def generation_options(**keywords: Unpack[GenerationKeywords]) -> GenerationOptions:
    """The options the keywords spell out (see `GenerationKeywords`)."""
    return options_of(None, keywords)


def seeded_sampling(
    *,
    temperature: float = GREEDY.temperature,
    top_k: int = GREEDY.top_k,
    top_p: float = GREEDY.top_p,
    min_p: float = GREEDY.min_p,
    seed: int | None = None,
) -> Sampling:
    """The Sampling asked for, with `seed`, or without one a seed drawn (and logged where it
    decides something: when sampling)."""
    sampling = Sampling(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed_or_drawn(seed)
    )
    if seed is None and not sampling.greedy:
        log.info("sampling seed drawn", seed=sampling.seed)
    return sampling
