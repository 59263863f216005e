"""What a request brings in, checked before any work starts and made ready off the event
loop: its text or messages encoded, its size against the context, its grammar's matcher."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import trio

from lever_actors.checkpoints.tokenizer import Message, Tokenizer
from lever_actors.config import check_request_size
from lever_actors.engine.state import RequestState
from lever_actors.errors import ConfigError, ContextLengthError
from lever_actors.model.grammar import Grammar
from lever_actors.model.matcher import Matcher
from lever_actors.options import GenerationOptions
from lever_actors.plan.context import Context
from lever_actors.progress import Progress

# a prompt whose length alone bounds its tokens past this many times the room is refused
# unencoded; nearer the room it is encoded (the engine then refuses it by its count)
LENGTH_ONLY = 2


class Asked(NamedTuple):
    """A request as `Engine.stream` takes it."""

    prompt: str | Sequence[int] | None  # text (no chat template) or token ids
    messages: Sequence[Message] | None  # or a conversation, which the template renders
    tools: Sequence[Mapping[str, Any]] | None  # function definitions, with messages
    options: GenerationOptions
    progress: Progress | None


async def take_in(
    asked: Asked, tokenizer: Tokenizer | None, vocab_size: int, context: Context
) -> RequestState:
    """The request's state, once everything about it is checked: one of prompt and
    messages, its ids in the vocabulary, its size within `context`; text encoded and a
    grammar compiled on worker threads (neither is a torch op)."""
    prompt, messages, tools, options, progress = asked
    if (prompt is None) == (messages is None):
        raise ConfigError("give either prompt or messages")
    if tools and messages is None:
        raise ConfigError("tools go with messages, which the chat template renders")
    if messages is not None or isinstance(prompt, str):
        encode = partial(tokens_of, _needed(tokenizer), prompt, messages, tools, options, context)
        ids = await trio.to_thread.run_sync(encode)
    else:
        assert prompt is not None  # one of the two, checked above
        ids = [int(t) for t in prompt]
    check_request_size(len(ids), options.max_new_tokens, context.tokens, context.why)
    if any(not 0 <= t < vocab_size for t in ids):
        raise ConfigError(f"prompt token ids must be in [0, {vocab_size})")
    matcher = None
    if options.grammar is not None:
        start = partial(grammar_matcher, options.grammar, _needed(tokenizer), vocab_size)
        matcher = await trio.to_thread.run_sync(start)
    return RequestState(ids, options, progress, matcher)


def _needed(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise ConfigError("this target has no tokenizer: pass the prompt as token ids")
    return tokenizer


def tokens_of(
    tokenizer: Tokenizer,
    prompt: str | Sequence[int] | None,
    messages: Sequence[Message] | None,
    tools: Sequence[Mapping[str, Any]] | None,
    options: GenerationOptions,
    context: Context,
) -> list[int]:
    """Blocking (a worker thread): the text, or `messages` rendered, encoded; unless its
    length alone shows that it cannot fit `context` (then ContextLengthError, at once):
    its bound passes LENGTH_ONLY times the room. Nearer, the text is encoded and counted,
    since a tokenizer may drop text the bound counts (runs of whitespace, say)."""
    text = tokenizer.apply_chat_template(messages, tools) if messages is not None else prompt
    assert isinstance(text, str)  # text, or messages rendered (the engine's check)
    room = context.tokens - options.max_new_tokens
    if len(text.encode()) > LENGTH_ONLY * room:  # only then can the bound pass it
        least = tokenizer.fewest_tokens(text)
        if least > LENGTH_ONLY * room:
            raise ContextLengthError(
                f"prompt (at least {least} tokens: {len(text):,} characters) + "
                f"max_new_tokens ({options.max_new_tokens}) exceeds the context of "
                f"{context.tokens} tokens ({context.why})",
                least,
                context.tokens,
            )
    return tokenizer.encode(text)


def grammar_matcher(grammar: Grammar, tokenizer: Tokenizer, vocab_size: int) -> Matcher:
    """Blocking (a worker thread): a request's matcher at the start of its text; the
    tokenizer's view for grammars is built on the first (about a second)."""
    return Matcher(grammar, tokenizer.grammar_vocabulary(vocab_size), vocab_size)
