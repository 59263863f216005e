"""Tokenizer from GGUF metadata and from an HF tokenizer.json: round trips, specials, streaming."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

from lever_actors.checkpoints.gguf_tokenizer import _QWEN2_SPLIT, tokenizer_from_gguf
from lever_actors.checkpoints.tokenizer import Tokenizer, user_turn
from lever_actors.errors import CheckpointError

TEXTS = [
    "Hello, world!",
    "def square(x: int) -> int:\n    return x ** 2  # squares\n",
    "for (int i = 0; i < n; ++i) { s += a[i]; }\t// C\r\n",
    "naïve café — déjà vu, Straße, 日本語のテキスト, русский текст",
    "emoji 🎉👩‍💻🇫🇷 mixed in",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<think>reason</think> then answer<|endoftext|>",
    "  leading and trailing spaces  ",
    "\n\n\nblank lines\n\n",
    "",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def main():\n    print('hello world')\n    return 0\n",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "naïve café déjà vu 日本語 テキスト русский",
]
Vocab = tuple[list[str], list[str]]  # tokens by id, merges as "a b"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens
USER_DEFINED = ["<think>", "</think>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@pytest.fixture(scope="module")
def bpe() -> Vocab:
    """A tiny byte-level BPE (tokens by id, merges as 'a b'), trained on CORPUS."""
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trained.train_from_iterator(CORPUS, trainer)
    model = json.loads(trained.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens + SPECIALS + USER_DEFINED, merges


def _write_vocab_gguf(
    path: Path,
    tokens: list[str],
    merges: list[str],
    model: str = "gpt2",
    add_bos: bool = False,
    pre: str = "qwen2",
) -> None:
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for i, t in enumerate(tokens):
        if t in SPECIALS:
            types[i] = gguf.TokenType.CONTROL
        elif t in USER_DEFINED:
            types[i] = gguf.TokenType.USER_DEFINED
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_tokenizer(bpe: Vocab, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("gguf") / "vocab.gguf"
    _write_vocab_gguf(path, *bpe)
    return tokenizer_from_gguf(gguf.GGUFReader(path), path)


@pytest.fixture(scope="module")
def hf_tokenizer(bpe: Vocab, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    tokens, merges = bpe
    n_base = len(tokens) - len(SPECIALS) - len(USER_DEFINED)
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens[:n_base])},
            merges=[tuple(m.split(" ")) for m in merges],
        )
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    backend.add_tokens(USER_DEFINED)
    folder = tmp_path_factory.mktemp("hf")
    backend.save(str(folder / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>"}, "bos_token": None, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    eos = [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return Tokenizer.from_file(folder / "tokenizer.json")


@pytest.fixture(params=["gguf", "hf"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_encode_whole(tok: Tokenizer, bpe: Vocab) -> None:
    tokens = bpe[0]
    for special in SPECIALS + USER_DEFINED:
        assert tok.encode(special) == [tokens.index(special)]
    ids = tok.encode("a<|im_end|>b")
    assert tokens.index("<|im_end|>") in ids
    assert tok.decode(ids, skip_special=True) == "ab"


def test_gguf_and_hf_agree(gguf_tokenizer: Tokenizer, hf_tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        assert gguf_tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert gguf_tokenizer.vocab_size == hf_tokenizer.vocab_size
    assert gguf_tokenizer.eos_ids == hf_tokenizer.eos_ids


def test_special_ids(tok: Tokenizer, bpe: Vocab) -> None:
    tokens = bpe[0]
    assert tok.eos_ids == {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")}
    assert tok.vocab_size == len(tokens)
    assert tok.encode("x")[0] != tok.bos_id  # add_bos is off for this vocabulary


def test_chat_template(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(user_turn("Write fizzbuzz."))
    assert prompt == "<|im_start|>user\nWrite fizzbuzz.<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_renders_system_and_turns(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_without_a_template_turns_are_joined_with_a_warning(tok: Tokenizer, caplog) -> None:
    bare = Tokenizer(
        tok.backend, eos_ids=[], bos_id=None, chat_template=None, vocab_size=1, source="bare"
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert bare.apply_chat_template(messages) == "Be brief.\n\nHi"
    assert caplog.messages == ["no chat template: the messages are joined as raw text model=bare"]


def test_special_tokens_are_left_out_of_streamed_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    decoder = tok.stream_decoder(skip_special=True)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == "user\nhi"


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    deltas = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stream_decoder_holds_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1  # the tiny vocabulary spells the emoji as several byte tokens
    stream = tok.stream_decoder()
    assert [stream.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_gguf_bos_added_when_asked(bpe: Vocab, tmp_path: Path) -> None:
    path = tmp_path / "bos.gguf"
    _write_vocab_gguf(path, *bpe, add_bos=True)
    tok = tokenizer_from_gguf(gguf.GGUFReader(path), path)
    assert tok.encode("hi")[0] == tok.bos_id == bpe[0].index("<|endoftext|>")


@pytest.mark.parametrize("model", ["t5", "bert", "rwkv"])
def test_unsupported_tokenizer_model(bpe: Vocab, tmp_path: Path, model: str) -> None:
    path = tmp_path / f"{model}.gguf"
    _write_vocab_gguf(path, *bpe, model=model)
    with pytest.raises(CheckpointError) as err:
        tokenizer_from_gguf(gguf.GGUFReader(path), path)
    assert str(err.value) == (
        f"{path}: unsupported tokenizer.ggml.model {model!r}; "
        "supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)"
    )


def test_smollm_splits_every_digit(tmp_path: Path) -> None:
    """GGUF pre "smollm" against SmolLM's tokenizer.json shape (digits split one by one, then
    GPT-2's byte-level pattern), on merges learned without that split: "12", " 1" exist."""
    numbers = ["x = 12345 + 678 * 90;", "in 2024 and 1999, 100% of 12 items", "v1.23 -> v12.3"]
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trained.train_from_iterator(CORPUS + numbers * 5, trainer)
    model = json.loads(trained.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert {"1 2", "Ġ 1"} <= set(merges)
    path = tmp_path / "smollm.gguf"
    _write_vocab_gguf(path, tokens + SPECIALS + USER_DEFINED, merges, pre="smollm")
    ours = tokenizer_from_gguf(gguf.GGUFReader(path), path)
    smollm = trained
    smollm.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre]
    )
    for text in TEXTS[:5] + numbers:
        assert ours.encode(text) == smollm.encode(text).ids
        assert ours.decode(ours.encode(text)) == text
    assert len(ours.encode("12345")) == 5


def test_bad_tokenizer_json(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json: cannot read tokenizer"):
        Tokenizer.from_file(path)


def test_files_of_the_same_bytes_share_one_parsed_vocabulary(
    gguf_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    for name in ("draft", "target", "other"):
        (tmp_path / name).mkdir()
        gguf_tokenizer.save(tmp_path / name)
    other = tmp_path / "other" / "tokenizer.json"
    other.write_text(other.read_text().replace('"<|im_end|>"', '"<|im_stop|>"'))
    draft, target, changed = (
        Tokenizer.from_file(tmp_path / name / "tokenizer.json")
        for name in ("draft", "target", "other")
    )
    assert draft.backend is target.backend  # parsed once
    assert changed.backend is not draft.backend
    assert changed.backend.token_to_id("<|im_stop|>") == draft.backend.token_to_id("<|im_end|>")


def test_save_round_trips_special_tokens_and_template(
    gguf_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    gguf_tokenizer.save(tmp_path)
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert loaded.eos_ids == gguf_tokenizer.eos_ids
    assert loaded.bos_id == gguf_tokenizer.bos_id
    assert loaded.chat_template == gguf_tokenizer.chat_template
    assert loaded.apply_chat_template(user_turn("hi")) == gguf_tokenizer.apply_chat_template(
        user_turn("hi")
    )
    for text in TEXTS:
        assert loaded.encode(text) == gguf_tokenizer.encode(text)
