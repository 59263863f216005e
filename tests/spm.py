"""Tiny SentencePiece BPE models trained here, and the GGUF tokenizer metadata llama.cpp's
converter writes for them: the test oracle for SentencePiece vocabularies in GGUF files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import gguf
import sentencepiece
from gguf import GGUFValueType as V

CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat watches.",
    "def main():\n    print('hello world')\n    return 0\n",
    "import numpy as np\nx = np.zeros((3, 4))\nfor i in range(10):\n        x += i\n",
    "naïve café déjà vu, русский текст, 日本語のテキスト",
    "Pack my box with five dozen liquor jugs! How vexingly quick daft zebras jump.",
    "    indented   code\twith\ttabs and    runs of   spaces",
    "Numbers 1234 and 5678, prices $9.99; e-mail: someone at example dot com",
]
CONTROL = ["<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["<think>", "</think>"]
STYLES = {
    # SentencePiece's default special ids, a "▁" before the text: Llama 2, Mistral
    "llama": dict(add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
    # Gemma's special ids and spellings, no "▁" before the text
    "gemma": dict(
        add_dummy_prefix=False,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
    ),
}
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def train(style: str, directory: Path) -> Path:
    """A tiny SentencePiece BPE model with byte fallback, saved as tokenizer.model."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 10),
        model_writer=model,
        model_type="bpe",
        vocab_size=600,
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=USER_DEFINED,
        control_symbols=CONTROL,
        split_digits=True,
        allow_whitespace_only_pieces=True,  # "▁▁▁" pieces, as Llama's
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
        **STYLES[style],
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def piece_type(sp: sentencepiece.SentencePieceProcessor, i: int) -> gguf.TokenType:
    # the order llama.cpp's converter asks in
    if sp.is_unknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.is_control(i):
        return gguf.TokenType.CONTROL
    if sp.is_unused(i):
        return gguf.TokenType.UNUSED
    if sp.is_byte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL


def metadata(sp: sentencepiece.SentencePieceProcessor, style: str) -> dict[str, Any]:
    """The tokenizer metadata llama.cpp's converter writes for `sp`: every id's piece, score
    and type; then the model's added tokens (tokenizer_config.json), here the user-defined
    symbols, retyped USER_DEFINED with score -1000."""
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    scores = [sp.get_score(i) for i in range(n)]
    types = [int(piece_type(sp, i)) for i in range(n)]
    for symbol in USER_DEFINED:
        i = sp.piece_to_id(symbol)
        types[i], scores[i] = int(gguf.TokenType.USER_DEFINED), -1000.0
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": style == "llama",
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": GEMMA_TEMPLATE,
    }
    if sp.pad_id() >= 0:
        fields["tokenizer.ggml.padding_token_id"] = sp.pad_id()
    return fields


def write_fields(path: Path, fields: dict[str, Any]) -> Path:
    """A GGUF file holding only `fields` (no tensors: the tokenizer reads none)."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in fields.items():
        writer.add_key_value(key, value, *gguf_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_type(value: Any) -> tuple[V, V | None]:
    if isinstance(value, list):
        return V.ARRAY, gguf_type(value[0])[0]
    kinds = {bool: V.BOOL, int: V.INT32, float: V.FLOAT32, str: V.STRING}
    return kinds[type(value)], None
