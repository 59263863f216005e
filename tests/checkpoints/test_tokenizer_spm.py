"""SentencePiece vocabularies in GGUF files (Llama 2, Mistral, Gemma, Phi-3): our tokenizer,
rebuilt from the metadata alone, against the sentencepiece library on the .model file the
metadata came from, and against transformers' tokenizers converted from that same file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import pytest
import sentencepiece

from lever_actors.checkpoints.gguf_tokenizer import merges_from_scores, tokenizer_from_gguf
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.errors import CheckpointError, ConfigError
from tests.spm import CONTROL, GEMMA_TEMPLATE, STYLES, USER_DEFINED, metadata, train, write_fields

# Texts without a whole token: sentencepiece itself is the oracle.
PLAIN = [
    "Hello world, the quick brown fox.",
    "def main():\n    print('hello world')\n    return 0\n",
    "naïve café déjà vu, Straße",  # ß never seen: bytes
    "日本語のテキスト 中文 한국어",  # mostly unseen: bytes
    "emoji 🎉👩‍💻 mixed in",  # four-byte characters, a joiner
    "  leading and trailing spaces  ",
    " one leading space",
    "multiple   spaces\tand\ttabs",
    "\n\nnewlines\n\n",
    "\r\nwindows line\r\n",
    "ZQX@#%^&*~`|{}",  # absent from the corpus
    "<start_of_turn",  # almost a control token: plain text
    " ",
    "",
]
# Texts with control, user-defined and unknown tokens, which match whole.
WHOLE = [
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<think>reason</think> then answer",
    "a <think> b",
    "x<end_of_turn>",
    "<end_of_turn><start_of_turn>",
    "<unk> written out",
]


def _read(path: Path) -> Tokenizer:
    return tokenizer_from_gguf(gguf.GGUFReader(path), path)


class Case:
    """One style's .model file, its sentencepiece processor and our tokenizer from its GGUF."""

    def __init__(self, style: str, root: Path) -> None:
        self.style = style
        self.model = train(style, root / style)
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(self.model))
        self.fields = metadata(self.sp, style)
        self.tok = _read(write_fields(root / f"{style}.gguf", self.fields))
        self.whole = CONTROL + USER_DEFINED + [self.sp.id_to_piece(self.sp.unk_id())]

    def sp_encode(self, text: str) -> list[int]:
        """sentencepiece on each stretch of text between whole tokens, as llama.cpp runs it:
        each stretch gets the "▁" prefix, when the model adds one, as a whole text would."""
        ids = []
        for part in self.split(text):
            ids += [self.sp.piece_to_id(part)] if part in self.whole else self.sp.encode(part)
        return ids

    def split(self, text: str) -> list[str]:
        longest_first = sorted(self.whole, key=len, reverse=True)
        pattern = "(" + "|".join(map(re.escape, longest_first)) + ")"
        return [part for part in re.split(pattern, text) if part]


@pytest.fixture(scope="module", params=list(STYLES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp("spm"))


def test_the_vocabulary_is_read_whole(case: Case) -> None:
    assert case.tok.vocab_size == case.sp.get_piece_size()
    assert case.tok.bos_id == case.sp.bos_id()
    assert case.sp.eos_id() in case.tok.eos_ids
    assert case.tok.backend.id_to_token(300) == case.sp.id_to_piece(300)


@pytest.mark.parametrize("text", PLAIN)
def test_encode_is_sentencepiece_with_bos(case: Case, text: str) -> None:
    assert case.tok.encode(text) == [case.sp.bos_id(), *case.sp.encode(text)]


def test_unseen_characters_fall_back_to_bytes(case: Case) -> None:
    ids = case.tok.encode("ß🎉")[1:]
    pieces = [case.sp.id_to_piece(i) for i in ids]
    assert "<0xC3>" in pieces and "<0x9F>" in pieces and "<0xF0>" in pieces
    assert ids == case.sp.encode("ß🎉")


@pytest.mark.parametrize("text", WHOLE)
def test_whole_tokens_match_whole(case: Case, text: str) -> None:
    ids = case.tok.encode(text)
    assert ids == [case.sp.bos_id(), *case.sp_encode(text)]
    for token in case.whole:
        if token in text:
            assert case.sp.piece_to_id(token) in ids


def test_every_piece_is_a_merge(case: Case) -> None:
    """The merges rebuilt from the scores make every normal piece of two or more characters,
    and each piece, encoded alone, comes out as sentencepiece spells it."""
    fields = case.fields
    merges = merges_from_scores(
        fields["tokenizer.ggml.tokens"],
        fields["tokenizer.ggml.scores"],
        fields["tokenizer.ggml.token_type"],
    )
    pieces = zip(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"], strict=True)
    normal = {t for t, k in pieces if k == gguf.TokenType.NORMAL and len(t) > 1}
    assert {left + right for left, right in merges} == normal
    for piece in sorted(normal):
        text = piece.replace("\u2581", " ")
        assert case.tok.encode(text)[1:] == case.sp.encode(text)


@pytest.mark.parametrize("text", PLAIN)
def test_decode_inverts_encode(case: Case, text: str) -> None:
    ids = case.tok.encode(text)
    assert case.tok.decode(ids, skip_special=True) == text
    assert case.tok.decode(ids[1:]) == case.sp.decode(ids[1:]) == text


@pytest.mark.parametrize("text", WHOLE)
def test_decode_with_whole_tokens(case: Case, text: str) -> None:
    """Gemma's text comes back as it was. Llama's keeps the space its encoding put before
    each stretch of text after a whole token; only the one at the very start goes (as in
    llama.cpp, and in transformers' legacy Llama tokenizer)."""
    expected = text
    if case.style == "llama":
        spaced = "".join(p if p in case.whole else " " + p for p in case.split(text))
        expected = spaced.removeprefix(" ")
    assert case.tok.decode(case.tok.encode(text)[1:]) == expected


@pytest.mark.parametrize("text", PLAIN)
def test_stream_decoder(case: Case, text: str) -> None:
    ids = case.tok.encode(text)
    stream = case.tok.stream_decoder(skip_special=True)
    deltas = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_streamed_continuation_keeps_its_leading_space(case: Case) -> None:
    """A continuation streamed after its prompt reads as the whole text decoded, minus the
    prompt: the first generated token's "▁" is a space, not a start-of-text to strip."""
    whole = case.tok.encode("hello world again")
    cut = next(i for i in range(2, len(whole)) if case.sp.id_to_piece(whole[i]).startswith("▁"))
    prompt, generated = whole[:cut], whole[cut:]
    stream = case.tok.stream_decoder(skip_special=True, context=prompt[-1:])
    streamed = "".join(stream.push(i) for i in generated) + stream.flush()
    full, head = (
        case.tok.decode(whole, skip_special=True),
        case.tok.decode(prompt, skip_special=True),
    )
    assert streamed == full[len(head) :]
    assert streamed.startswith(" ")


def test_chat_template_from_themetadata(case: Case) -> None:
    assert case.tok.chat_template == GEMMA_TEMPLATE
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello "},
        {"role": "user", "content": "Bye"},
    ]
    bos = case.sp.id_to_piece(case.sp.bos_id())
    prompt = case.tok.apply_chat_template(messages)
    assert prompt == (
        f"{bos}<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    # one BOS: the template's, not a second added before it
    assert case.tok.encode(prompt) == [case.sp.bos_id(), *case.sp_encode(prompt[len(bos) :])]
    with pytest.raises(ConfigError, match="chat template: System role not supported"):
        case.tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ConfigError, match="roles must alternate"):
        case.tok.apply_chat_template(messages[:1] * 2)


def test_end_of_turn_stops_generation(case: Case) -> None:
    assert case.sp.piece_to_id("<end_of_turn>") in case.tok.eos_ids


@pytest.fixture(scope="module")
def transformers_tokenizer(case: Case) -> Any:
    """transformers' tokenizer for `case`, converted from the same .model file."""
    transformers = pytest.importorskip("transformers")
    try:
        if case.style == "gemma":
            return transformers.GemmaTokenizer.from_pretrained(str(case.model.parent))
        # legacy: a "▁" before every stretch of text between whole tokens, as llama.cpp does
        return transformers.LlamaTokenizer.from_pretrained(str(case.model.parent), legacy=True)
    except Exception as cause:  # converting needs sentencepiece and protobuf
        pytest.skip(f"transformers cannot convert the .model file: {cause}")


def test_transformers_agrees(case: Case, transformers_tokenizer: Any) -> None:
    """transformers' tokenizers from the same .model give the same ids and text. Its Llama
    one adds no "▁" before a stretch of text that starts with a space (its Metaspace skips
    it), where sentencepiece and llama.cpp do: those texts are left to sentencepiece."""

    def comparable(text: str) -> bool:
        stretches = [p for p in case.split(text) if p not in case.whole]
        return case.style == "gemma" or not any(p.startswith(" ") for p in stretches)

    texts = [t for t in PLAIN + WHOLE if comparable(t)]
    assert len(texts) >= 14
    for text in texts:
        ids = case.tok.encode(text)[1:]
        assert ids == transformers_tokenizer.encode(text, add_special_tokens=False), text
        assert case.tok.decode(ids) == transformers_tokenizer.decode(ids), text


def _handmade(tmp_path: Path, scores: dict[str, float], **changes: Any) -> Tokenizer:
    """A Gemma-style vocabulary of the pieces `scores` names (no bytes, no "▁" prefix)."""
    tokens = ["<unk>", "<bos>", "<eos>", *scores]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, *scores.values()],
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * len(scores),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": False,
    }
    fields = {k: v for k, v in (fields | changes).items() if v is not None}
    return _read(write_fields(tmp_path / "handmade.gguf", fields))


@pytest.mark.parametrize(
    ("scores", "pieces"),
    [
        pytest.param({"ab": -1.0, "bc": -2.0}, ["ab", "c"], id="ab-scores-higher"),
        pytest.param({"ab": -2.0, "bc": -1.0}, ["a", "bc"], id="bc-scores-higher"),
        pytest.param({"ab": -1.0, "bc": -1.0}, ["ab", "c"], id="tie-lower-id-first"),
        pytest.param({"ab": -3.0, "bc": -1.0, "abc": -2.0}, ["abc"], id="bc-then-abc"),
        pytest.param({"ab": -1.0, "bc": -3.0, "abc": -2.0}, ["abc"], id="ab-then-abc"),
    ],
)
def test_the_highest_scoring_piece_merges_first(tmp_path: Path, scores, pieces) -> None:
    chars = {"a": -10.0, "b": -11.0, "c": -12.0}
    tok = _handmade(tmp_path, chars | scores)
    ids = tok.encode("abc")
    assert ids[0] == tok.bos_id  # llama.cpp's default for a SentencePiece vocabulary
    assert [tok.backend.id_to_token(i) for i in ids[1:]] == pieces


def test_bos_and_eos_as_the_metadata_says(tmp_path: Path) -> None:
    chars = {"a": -1.0, "b": -2.0}
    plain = _handmade(tmp_path, chars, **{"tokenizer.ggml.add_bos_token": False})
    assert plain.encode("ab") == [3, 4]
    both = _handmade(tmp_path, chars, **{"tokenizer.ggml.add_eos_token": True})
    assert both.encode("ab") == [1, 3, 4, 2]
    assert both.decode(both.encode("ab"), skip_special=True) == "ab"


def test_without_byte_tokens_unknown_characters_are_one_unk(tmp_path: Path) -> None:
    tok = _handmade(tmp_path, {"a": -1.0, "b": -2.0})
    assert tok.encode("a日本b") == [1, 3, 0, 4]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tokenizer.ggml.scores": [0.0] * 5}, "6 tokens but 5 scores"),
        ({"tokenizer.ggml.scores": None}, "needs tokenizer.ggml.scores (or merges)"),
        ({"tokenizer.ggml.scores": ["x"] * 6}, "tokenizer.ggml.scores must be a list of numbers"),
        ({"tokenizer.ggml.token_type": [1] * 5}, "6 tokens but 5 token types"),
        ({"tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 9]}, "token 5 has type 9"),
        ({"tokenizer.ggml.token_type": [2, 3, 3, 1, 6, 1]}, "byte token 'b' is not spelled <0xXX>"),
        (
            {"tokenizer.ggml.bos_token_id": 6},
            "tokenizer.ggml.bos_token_id: special token id 6 is not one of the 6 tokens",
        ),
        (
            {"tokenizer.ggml.unknown_token_id": 60},
            "tokenizer.ggml.unknown_token_id: special token id 60 is not one of the 6 tokens",
        ),
        ({"tokenizer.ggml.merges": ["a q"]}, "bad tokenizer vocab or merges"),
    ],
)
def test_inconsistent_metadata_is_refused(tmp_path: Path, changes, message) -> None:
    with pytest.raises(CheckpointError) as err:
        _handmade(tmp_path, {"a": -1.0, "b": -2.0, "ab": -0.5}, **changes)
    assert str(err.value).startswith(f"{tmp_path / 'handmade.gguf'}: ")
    assert message in str(err.value)
