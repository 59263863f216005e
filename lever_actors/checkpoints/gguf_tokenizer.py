"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

Two kinds: "gpt2", a byte-level BPE whose merges the file lists, and "llama", a SentencePiece
BPE (Llama 2, Mistral, Gemma, Phi-3) whose merges are rebuilt from the pieces' scores. Either
way, control and user-defined tokens match whole in text, as llama.cpp matches them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.errors import CheckpointError

# Pre-tokenizer split patterns, applied in order, keyed by GGUF `tokenizer.ggml.pre`.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_DIGIT_SPLIT = r"\p{N}"
_SPLITS: dict[str, tuple[str, ...]] = {
    "qwen2": (_QWEN2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "smollm": (_DIGIT_SPLIT, _GPT2_SPLIT),  # every digit alone, then GPT-2's pattern
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
}
_NFC_PRE = {"qwen2"}  # Qwen's own tokenizer.json normalizes to NFC first
_WHOLE_WORD_PRE = {"llama-bpe", "llama3"}  # Llama 3 looks a whole pre-token up before merging

# GGUF token types (llama.cpp's enum; 0 is "undefined").
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_TOKEN_TYPES = range(7)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")  # how SentencePiece spells a byte-fallback piece
SPACE = "\u2581"  # SentencePiece's visible space, "▁"
_END_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")


class GgufTokenizer(NamedTuple):
    """What `Tokenizer` is built from."""

    backend: tokenizers.Tokenizer
    eos_ids: list[int]
    bos_id: int | None
    chat_template: str | None
    vocab_size: int


class _Metadata:
    """The file's key-value metadata, with errors that name the file."""

    def __init__(self, reader: gguf.GGUFReader, source: Path) -> None:
        self._reader = reader
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.get_field(key)
        return default if field is None else field.contents()

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {message}")


class _Vocab(NamedTuple):
    tokens: list[str]  # by id
    types: list[int]  # by id, llama.cpp's enum

    def ids(self) -> dict[str, int]:
        # a duplicate keeps its last id, as in llama.cpp
        return {t: i for i, t in enumerate(self.tokens)}

    def of_type(self, *kinds: int) -> list[str]:
        return [t for t, k in zip(self.tokens, self.types, strict=True) if k in kinds]


def read_gguf_tokenizer(reader: gguf.GGUFReader, source: Path) -> GgufTokenizer:
    """The tokenizer `tokenizer.ggml.*` describes, or CheckpointError naming the bad key."""
    meta = _Metadata(reader, source)
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise meta.error(
            f"unsupported tokenizer.ggml.model {kind!r}; "
            "supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)"
        )
    vocab = _read_vocab(meta)
    backend, add_bos_default = _BUILDERS[kind](meta, vocab)
    bos_id = _token_id(meta, vocab, "bos_token_id")
    eos_ids = [_token_id(meta, vocab, key) for key in _END_KEYS]
    add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos_default)
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    _add_bos_eos(backend, vocab, bos_id if add_bos else None, eos_ids[0] if add_eos else None)
    return GgufTokenizer(
        backend,
        eos_ids=[i for i in eos_ids if i is not None],
        bos_id=bos_id,
        chat_template=meta.get("tokenizer.chat_template"),
        vocab_size=len(vocab.tokens),
    )


def _read_vocab(meta: _Metadata) -> _Vocab:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise meta.error("tokenizer.ggml.tokens must be a list of strings")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise meta.error(f"{len(tokens)} tokens but {len(types)} token types")
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise meta.error("tokenizer.ggml.tokens must be a non-empty list of strings")
    bad = next((i for i, k in enumerate(types) if k not in _TOKEN_TYPES), None)
    if bad is not None:
        raise meta.error(f"token {bad} has type {types[bad]!r}; llama.cpp's types are 0 to 6")
    return _Vocab(tokens, types)


def _token_id(meta: _Metadata, vocab: _Vocab, key: str) -> int | None:
    """`tokenizer.ggml.<key>`, checked to name one of the tokens."""
    token_id = meta.get(f"tokenizer.ggml.{key}")
    in_range = isinstance(token_id, int) and 0 <= token_id < len(vocab.tokens)
    if token_id is not None and not in_range:
        raise meta.error(
            f"tokenizer.ggml.{key}: special token id {token_id!r} is not one of the "
            f"{len(vocab.tokens)} tokens"
        )
    return token_id


def _byte_level_bpe(meta: _Metadata, vocab: _Vocab) -> tuple[tokenizers.Tokenizer, bool]:
    """GPT-2-style BPE over bytes spelled as characters, merges from the file."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _SPLITS:
        raise meta.error(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(_SPLITS)}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = _bpe(meta, vocab.ids(), merges, ignore_merges=pre in _WHOLE_WORD_PRE)
    if pre in _NFC_PRE:
        backend.normalizer = normalizers.NFC()
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in _SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _add_whole_tokens(backend, vocab, special=(CONTROL,))
    return backend, False  # BOS only where the file asks for it


def _sentencepiece_bpe(meta: _Metadata, vocab: _Vocab) -> tuple[tokenizers.Tokenizer, bool]:
    """SentencePiece BPE: spaces as "▁", a "▁" before the text unless the file says not, and
    bytes (<0xE6>) for characters outside the vocabulary."""
    bytes_ = vocab.of_type(BYTE)
    misnamed = next((t for t in bytes_ if not _BYTE_TOKEN.fullmatch(t)), None)
    if misnamed is not None:
        raise meta.error(f"byte token {misnamed!r} is not spelled <0xXX>")
    backend = _bpe(
        meta,
        vocab.ids(),
        _stored_or_scored_merges(meta, vocab),
        unk_token=_unknown_token(meta, vocab),
        byte_fallback=bool(bytes_),
        fuse_unk=True,  # SentencePiece gives a run of unknown characters one <unk>
    )
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)  # llama.cpp's default
    # Before each stretch of text between whole tokens, as llama.cpp adds it.
    prefix = [normalizers.Prepend(SPACE)] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []  # the prefix is not the text's
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    # llama.cpp also matches the unknown token's text whole, like a control token.
    _add_whole_tokens(backend, vocab, special=(CONTROL, UNKNOWN))
    return backend, True  # llama.cpp adds BOS to SentencePiece text unless told not to


def _stored_or_scored_merges(meta: _Metadata, vocab: _Vocab) -> list[tuple[str, str]]:
    stored = meta.get("tokenizer.ggml.merges")
    if stored is not None:
        return [tuple(m.split(" ", 1)) for m in stored]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise meta.error("a SentencePiece vocabulary needs tokenizer.ggml.scores (or merges)")
    if not isinstance(scores, list) or not all(isinstance(s, int | float) for s in scores):
        raise meta.error("tokenizer.ggml.scores must be a list of numbers")
    if len(scores) != len(vocab.tokens):
        raise meta.error(f"{len(vocab.tokens)} tokens but {len(scores)} scores")
    return merges_from_scores(vocab.tokens, scores, vocab.types)


def merges_from_scores(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, which its files do not store: two adjacent pieces join when
    their concatenation is a piece, the highest-scoring result first (ties: the lower id).
    Every split of a piece into two pieces is a merge of that rank."""
    # Only normal pieces join or are joined: special, byte and unused ones never come of a merge.
    pieces = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k in (0, NORMAL)}
    merges = []
    for piece in sorted(pieces, key=lambda t: (-scores[pieces[t]], pieces[t])):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                merges.append((left, right))
    return merges


def _unknown_token(meta: _Metadata, vocab: _Vocab) -> str | None:
    unknown = _token_id(meta, vocab, "unknown_token_id")
    if unknown is not None:
        return vocab.tokens[unknown]
    return next(iter(vocab.of_type(UNKNOWN)), None)


def _bpe(
    meta: _Metadata, ids: dict[str, int], merges: list[tuple[str, str]], **options: Any
) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer(models.BPE(vocab=ids, merges=merges, **options))
    except Exception as cause:  # tokenizers rejects merges naming tokens outside the vocab
        raise meta.error(f"bad tokenizer vocab or merges: {cause}") from cause


def _add_whole_tokens(
    backend: tokenizers.Tokenizer, vocab: _Vocab, special: tuple[int, ...]
) -> None:
    """Control and user-defined tokens match whole in the raw text, never cut into pieces."""
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in vocab.of_type(*special)]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in vocab.of_type(USER_DEFINED)]
    )


def _add_bos_eos(
    backend: tokenizers.Tokenizer, vocab: _Vocab, bos_id: int | None, eos_id: int | None
) -> None:
    """BOS before and EOS after each text, where the file asks for them."""
    ends = [(vocab.tokens[i], i) for i in (bos_id, eos_id) if i is not None]
    if not ends:
        return
    bos = [vocab.tokens[bos_id]] if bos_id is not None else []
    eos = [vocab.tokens[eos_id]] if eos_id is not None else []
    # list-form templates, so a token with a space still parses
    backend.post_processor = processors.TemplateProcessing(
        single=[*bos, "$A", *eos], pair=[*bos, "$A", *eos, "$B:1", *eos], special_tokens=ends
    )


_BUILDERS: dict[str, Callable[[_Metadata, _Vocab], tuple[tokenizers.Tokenizer, bool]]] = {
    "gpt2": _byte_level_bpe,
    "llama": _sentencepiece_bpe,
}


def tokenizer_from_gguf(reader: gguf.GGUFReader, source: Path) -> Tokenizer:
    """The tokenizer rebuilt from a GGUF's `tokenizer.ggml.*` metadata."""
    return Tokenizer(**read_gguf_tokenizer(reader, source)._asdict(), source=str(source))
