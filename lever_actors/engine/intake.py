"""What a request brings in, made ready off the event loop: its text or messages encoded,
and its grammar's matcher."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lever_actors.checkpoints.tokenizer import Message, Tokenizer
from lever_actors.errors import ContextLengthError
from lever_actors.model.grammar import Grammar, Matcher
from lever_actors.options import GenerationOptions
from lever_actors.plan.context import Context


def tokens_of(
    tokenizer: Tokenizer,
    prompt: str | Sequence[int] | None,
    messages: Sequence[Message] | None,
    tools: Sequence[Mapping[str, Any]] | None,
    options: GenerationOptions,
    context: Context,
) -> list[int]:
    """Blocking (a worker thread): the text, or `messages` rendered, encoded; unless its
    length alone shows that it cannot fit `context` (then ContextLengthError, at once)."""
    text = tokenizer.apply_chat_template(messages, tools) if messages is not None else prompt
    assert isinstance(text, str)  # text, or messages rendered (the engine's check)
    room = context.tokens - options.max_new_tokens
    if len(text.encode()) > room:  # only then can the bound below exceed the room
        least = tokenizer.fewest_tokens(text)
        if least > room:
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
