"""Text <-> token ids for a checkpoint: an HF tokenizer.json, or the vocabulary in GGUF metadata."""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import llguidance
import tokenizers
from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lever_actors.device.manifest import Manifest
from lever_actors.errors import CheckpointError, ConfigError, LeverError
from lever_actors.logs import get_logger
from lever_actors.paths import file_inside

log = get_logger(__name__)

# Special tokens that end a turn or a document; the model stops on any of them it has.
_END_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
)
# vocabularies parsed, by their file's bytes: a draft and a target that ship the same
# tokenizer.json (the real pair does) parse it once and share it, 0.3 s of a start-up on the
# Xeon; nothing changes a parsed one
_PARSED: dict[bytes, tokenizers.Tokenizer] = {}
_PARSED_KEPT = 4
ROLES = ("system", "user", "assistant", "tool")
# keys a message may have beside role and content, by role: an assistant's calls of tools
# ({"function": {"name", "arguments": {...}}}), a tool's answer to one
OPTIONAL_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id", "name"}}
Message = Mapping[str, Any]
TEMPLATE_SECONDS = 2.0  # real chat templates render in milliseconds; past this, a runaway loop
_TEMPLATE_FILE = "<template>"  # the file name jinja2 gives code compiled from a string


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` with the model's special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_ids: list[int],
        bos_id: int | None,
        chat_template: str | None,
        vocab_size: int,
        source: str = "",
    ) -> None:
        self.backend = backend
        self.source = source  # where it was read from, for messages
        self.bos_id = bos_id
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self._eos_id = next(iter(eos_ids), None)  # the primary one, for chat templates
        ends = (backend.token_to_id(t) for t in _END_TOKENS)
        self.eos_ids: frozenset[int] = frozenset(eos_ids) | {i for i in ends if i is not None}
        self._adds_bos = bos_id is not None and backend.encode("").ids[:1] == [bos_id]
        self._grammar_vocabularies: dict[int, llguidance.LLTokenizer] = {}

    @classmethod
    def from_file(cls, path: Path) -> Tokenizer:
        """An HF tokenizer.json; tokenizer_config.json and generation_config.json beside it."""
        try:
            backend = _parsed(path.read_bytes())
        except Exception as cause:  # tokenizers raises a bare Exception on a bad file
            raise CheckpointError(f"{path}: cannot read tokenizer: {cause}") from cause
        config = _read_json(path.parent / "tokenizer_config.json")
        generation = _read_json(path.parent / "generation_config.json")
        template_file = path.parent / "chat_template.jinja"  # newer transformers save it apart
        template = config.get("chat_template")
        if template is None and template_file.is_file():
            template = template_file.read_text()
        eos_ids = [backend.token_to_id(_token_text(config.get("eos_token")) or "")]
        eos = generation.get("eos_token_id")
        eos_ids += eos if isinstance(eos, list) else [eos]
        bos_id = backend.token_to_id(_token_text(config.get("bos_token")) or "")
        return cls(
            backend,
            eos_ids=[i for i in eos_ids if i is not None],
            bos_id=bos_id,
            chat_template=template if isinstance(template, str) else None,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            source=str(path.parent),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; BOS is prepended only where the model's config asks for it,
        and not a second time before a text that starts with it (a chat template's own)."""
        ids = self.backend.encode(text).ids
        doubled = self._adds_bos and len(ids) > 1 and ids[1] == self.bos_id
        return ids[1:] if doubled else ids

    def fewest_tokens(self, text: str) -> int:
        """At most as many tokens as `encode(text)` gives, from its length alone: its UTF-8
        bytes over the most any token's text takes (a byte-level token's text takes at
        least as many as the bytes it stands for)."""
        return -(-len(text.encode()) // self._longest_token_bytes)

    @functools.cached_property
    def _longest_token_bytes(self) -> int:
        backend = self.backend  # id by id: no dict of the vocabulary (tens of MB)
        tokens = (backend.id_to_token(i) or "" for i in range(self.vocab_size))
        return max(1, *(len(t.encode()) for t in tokens))

    def has_token(self, text: str) -> bool:
        """Whether `text` is one token of this vocabulary."""
        return self.backend.token_to_id(text) is not None

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def apply_chat_template(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """The conversation (system, user, assistant and tool turns) in the model's own chat
        format, ending with the assistant's prompt; `tools` (function definitions: name,
        description, parameters) as the template presents them, where it does. Without a
        template: the turns' contents joined by blank lines, with a warning; a format is
        never invented."""
        checked = check_messages(messages)
        if tools and "tools" not in (self.chat_template or ""):
            raise ConfigError(f"{self.source}: the model's chat template takes no tools")
        if self.chat_template is None:
            log.warning("no chat template: the messages are joined as raw text", model=self.source)
            return "\n\n".join(m["content"] for m in checked)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _to_json
        env.globals["raise_exception"] = _raise_template_error
        try:
            with _time_limit(TEMPLATE_SECONDS, self.source):
                return env.from_string(self.chat_template).render(
                    messages=checked,
                    tools=[{"type": "function", "function": t} for t in tools or ()] or None,
                    add_generation_prompt=True,
                    bos_token=self._token(self.bos_id),
                    eos_token=self._token(self._eos_id),
                )
        except LeverError:
            raise
        except Exception as cause:  # the template is the checkpoint's code: so are its errors
            line = f" (line {cause.lineno})" if isinstance(cause, TemplateSyntaxError) else ""
            raise CheckpointError(f"{self.source}: broken chat template{line}: {cause}") from cause

    def save(self, directory: Path) -> None:
        """Write tokenizer.json and the config files `from_file` reads back."""
        self.backend.save(str(directory / "tokenizer.json"))
        config = {
            "eos_token": self._token(self._eos_id) or None,
            "bos_token": self._token(self.bos_id) or None,
            "chat_template": self.chat_template,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
        generation = {"eos_token_id": sorted(self.eos_ids)}
        (directory / "generation_config.json").write_text(json.dumps(generation))

    def stream_decoder(
        self, skip_special: bool = False, context: Sequence[int] = ()
    ) -> StreamDecoder:
        """Deltas of the tokens pushed after `context` (the prompt's last ids), which is
        decoded with them but never emitted: a SentencePiece token's leading space is kept."""
        return StreamDecoder(self, skip_special, context)

    def piece(self, token_id: int, after: int | None = None) -> str:
        """The text `token_id` adds after the id `after` (None: alone), decoded with it so
        that a leading space is kept; special tokens add none, a partial character U+FFFD."""
        if after is None:
            return self.decode([token_id], skip_special=True)
        before = self.decode([after], skip_special=True)
        return self.decode([after, token_id], skip_special=True)[len(before) :]

    def grammar_vocabulary(self, vocab_size: int) -> llguidance.LLTokenizer:
        """llguidance's view of these tokens, for grammars over a model's `vocab_size` logits;
        built once (about a second for 150k tokens). A grammar ends the text with an end
        token, so a tokenizer without one is refused (ConfigError), as is one whose decoder
        llguidance does not know (a word-level one)."""
        if vocab_size not in self._grammar_vocabularies:
            if not self.eos_ids:
                raise ConfigError(f"{self.source}: a grammar needs a tokenizer with an end token")
            try:  # it reads byte-level BPE and SentencePiece's byte fallback
                self._grammar_vocabularies[vocab_size] = llguidance.LLTokenizer(
                    self.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(self.eos_ids)
                )
            except ValueError as cause:
                why = f"{self.source}: grammars cannot read this tokenizer: {cause}"
                raise ConfigError(why) from None
        return self._grammar_vocabularies[vocab_size]

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id) or ""


class StreamDecoder:
    """Turns token ids, one at a time, into text deltas that never split a UTF-8 character."""

    def __init__(
        self, tokenizer: Tokenizer, skip_special: bool = False, context: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = list(context)
        self._prefix = 0  # ids[_prefix:_read] were emitted last; decoding from there gives context
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        """The text `token_id` completes; empty while a multi-byte character is partial."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes to U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        # Decoding a window rather than one id keeps decoders that drop a leading space correct.
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special=self._skip_special)


def user_turn(text: str) -> list[dict[str, str]]:
    """A conversation of one user message."""
    return [{"role": "user", "content": text}]


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Plain {"role", "content"} dicts (with an assistant's `tool_calls`, a tool's
    `tool_call_id` and `name`), or ConfigError naming the first bad message."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ConfigError("messages must be a non-empty list of {'role', 'content'} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not {"role", "content"} <= set(message):
            raise ConfigError(f"messages[{i}] must have the keys 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ConfigError(f"messages[{i}].role = {role!r}: expected one of {', '.join(ROLES)}")
        unknown = set(message) - {"role", "content"} - OPTIONAL_KEYS.get(role, set())
        if unknown:
            raise ConfigError(
                f"messages[{i}] ({role}) has unknown keys: {', '.join(sorted(unknown))}"
            )
        if not isinstance(content, str):
            raise ConfigError(f"messages[{i}].content must be a string")
        calls = message.get("tool_calls", [])
        if not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls):
            raise ConfigError(f"messages[{i}].tool_calls must be a list of objects")
        checked.append(dict(message))
    return checked


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as cause:
        raise CheckpointError(f"{path}: cannot read JSON: {cause}") from cause


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as {"content": ...}.
    return token.get("content") if isinstance(token, dict) else token


def _to_json(value: Any, indent: int | None = None) -> str:
    # HF templates expect plain JSON, not jinja2's HTML-escaped tojson.
    return json.dumps(value, indent=indent, ensure_ascii=False)


def _raise_template_error(message: str) -> None:
    # the template refusing the conversation (e.g. roles that do not alternate): bad input
    raise ConfigError(f"chat template: {message}")


@contextmanager
def _time_limit(seconds: float, source: str) -> Iterator[None]:
    """Stop template code that runs past `seconds`, in whatever thread renders it.

    A line tracer on the template's own frames raises inside the runaway loop itself: a
    thread cannot be killed, a signal reaches only the main thread, and the sandbox's call
    hooks never run in a loop that calls nothing.
    """
    deadline = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise CheckpointError(f"{source}: chat template took longer than {seconds:g} s")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def _parsed(text: bytes) -> tokenizers.Tokenizer:
    """The vocabulary of a tokenizer.json's bytes, parsed once per process (_PARSED)."""
    key = hashlib.sha256(text).digest()
    backend = _PARSED.get(key)
    if backend is None:
        backend = tokenizers.Tokenizer.from_str(text.decode())
        if len(_PARSED) >= _PARSED_KEPT:
            del _PARSED[next(iter(_PARSED))]  # the first parsed goes first
        _PARSED[key] = backend
    return backend


def layout_tokenizer(directory: Path, manifest: Manifest) -> Tokenizer | None:
    """The tokenizer the manifest names, read from inside the layout; None without one."""
    if manifest.tokenizer is None:
        return None
    return Tokenizer.from_file(file_inside(directory, manifest.tokenizer, "manifest tokenizer"))
