"""Each architecture end to end from a GGUF file with a SentencePiece vocabulary: converted
to a flash layout, streamed under a DRAM budget, verified in trees, its text exactly the
sequential greedy decoding of the same file."""

from __future__ import annotations

import pytest
import sentencepiece
import torch

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.gguf_file import load_gguf
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.model.sequential import sequential_cached
from lever_actors.model.transformer import Transformer
from tests.hf_to_gguf import write_gguf_of
from tests.spm import metadata, train
from tests.tiny_hf import tiny_model

CASES = [
    pytest.param("gemma2", "gemma", {"tie": True, "query_scale": 16}, id="gemma2-gemma-vocab"),
    pytest.param("phi3", "llama", {"window": 6}, id="phi3-llama-vocab"),
    pytest.param("mistral", "llama", {"window": None}, id="mistral-llama-vocab"),
    pytest.param("llama", "llama", {"tie": True}, id="tinyllama-style"),
]
PROMPT = "def main():\n    print('hello world')"
NEW = 24


@pytest.mark.parametrize(("arch", "style", "kwargs"), CASES)
@pytest.mark.parametrize("tree", ["gaincost", "static:3,2,1"])
async def test_engine_equals_sequential_decoding_of_the_gguf(arch, style, kwargs, tree, tmp_path):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(train(style, tmp_path / "sp")))
    model = tiny_model(arch, vocab=sp.get_piece_size(), layers=4, **kwargs)
    path = write_gguf_of(model, tmp_path / f"{arch}.gguf", metadata(sp, style))
    convert(path, tmp_path / "layout", torch.float64)
    ours = load_gguf(path, torch.float64)
    prompt = ours.tokenizer.encode(PROMPT)
    expected = sequential_cached(Transformer(ours.args, ours.weights), prompt, NEW)
    config = EngineConfig(
        target=str(tmp_path / "layout"), draft=str(path), tree=tree, dram_budget="75%"
    )
    async with Engine.open(config) as engine:
        result = await engine.generate(prompt=PROMPT, max_new_tokens=NEW)
    assert list(result.tokens) == expected
    tokenizer = ours.tokenizer
    gained = tokenizer.decode(prompt + expected, skip_special=True)[
        len(tokenizer.decode(prompt, skip_special=True)) :
    ]
    # a random model emits stray byte tokens: compare the text up to the first invalid byte
    valid = gained.split("\ufffd")[0]
    assert result.text.startswith(valid)
