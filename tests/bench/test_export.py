"""export-hf: a flash layout written back as an HF directory loads in our load_hf and in
transformers with the same weights and the same logits as the model it came from."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.export import INDEX_NAME, export_hf, write_hf
from lever_actors.checkpoints.hf import load_hf
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.cli import main
from lever_actors.errors import CheckpointError
from lever_actors.model.transformer import Transformer
from tests.tiny_hf import full_precision_norms, hf_cases, save_tiny, tiny_model

CASES = hf_cases("llama", "llama-rope-llama3", "qwen2", "qwen2-tied", "qwen3")
TOKENS = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))


def _weights_equal(a: Checkpoint, b: Checkpoint) -> None:
    assert a.args == b.args
    wa, wb = a.weights, b.weights
    for name in ("embed", "final_norm", "lm_head"):
        assert torch.equal(getattr(wa, name), getattr(wb, name)), name
    assert (wa.lm_head is wa.embed) == (wb.lm_head is wb.embed)
    for la, lb in zip(wa.layers, wb.layers, strict=True):
        assert la.keys() == lb.keys()
        for key in la:
            assert torch.equal(la[key], lb[key]), key


@pytest.mark.parametrize("case", CASES)
def test_flash_layout_round_trip(case, tmp_path):
    arch, kwargs = case
    original = tiny_model(arch, **kwargs)
    layout = tmp_path / "layout"
    convert(save_tiny(original, tmp_path / "hf"), layout, torch.float64)
    out = export_hf(layout, tmp_path / "export", torch.float64)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["architectures"] == [type(original).__name__]
    assert config["torch_dtype"] == "float64"
    assert config["tie_word_embeddings"] == kwargs.get("tie", False)

    # ours: the export holds exactly the layout's weights
    ours = load_hf(out, torch.float64)
    _weights_equal(ours, load_checkpoint(layout, torch.float64))

    # transformers: every tensor found, none left over, and the same logits as the original
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float64, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert type(theirs) is type(original)
    with full_precision_norms(), torch.no_grad():
        expected = original(TOKENS).logits
        got = theirs.eval()(TOKENS).logits
    assert torch.equal(got, expected)
    model = Transformer(ours.args, ours.weights)
    our_logits = model.logits(model.forward(TOKENS[0], model.new_cache(TOKENS.shape[1])))
    assert (our_logits - expected[0]).abs().max().item() <= 1e-9


def test_export_in_another_dtype_and_sharded(tmp_path):
    layout = tmp_path / "layout"
    convert(save_tiny(tiny_model("qwen2", layers=3), tmp_path / "hf"), layout, torch.float64)
    out = tmp_path / "export"
    checkpoint = load_checkpoint(layout, torch.bfloat16)
    out.mkdir()
    write_hf(checkpoint, out, torch.bfloat16, shard_bytes=20_000)
    index = json.loads((out / INDEX_NAME).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * 2 for t in [checkpoint.weights.embed, checkpoint.weights.final_norm]
    ) + sum(t.numel() * 2 for layer in checkpoint.weights.layers for t in layer.values()) + (
        checkpoint.weights.lm_head.numel() * 2
    )
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _weights_equal(load_hf(out, torch.bfloat16), checkpoint)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert theirs.dtype == torch.bfloat16


def test_tokenizer_files_round_trip(tmp_path):
    vocab = {f"t{i}": i for i in range(95)} | {"<|im_end|>": 95, "<s>": 96}
    backend = Backend(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = Tokenizer(
        backend, eos_ids=[95], bos_id=96, chat_template="{{ messages[0].content }}", vocab_size=97
    )
    model = tiny_model("qwen2")
    hf = load_hf(save_tiny(model, tmp_path / "hf"), torch.float32)
    hf.tokenizer = tokenizer
    out = tmp_path / "export"
    out.mkdir()
    write_hf(hf, out, torch.float32)
    back = load_hf(out, torch.float32).tokenizer
    assert back is not None
    assert back.eos_ids == tokenizer.eos_ids and back.bos_id == 96
    assert back.chat_template == tokenizer.chat_template
    assert back.encode("t3 t4 t5") == [3, 4, 5]
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == 95 and config["bos_token_id"] == 96
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.bos_token_id == 96


def test_cli_and_refusals(tmp_path, capsys):
    layout = tmp_path / "layout"
    convert(save_tiny(tiny_model("llama"), tmp_path / "hf"), layout, torch.float32)
    assert main(["export-hf", str(layout), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float32"
    assert "HF safetensors directory" in capsys.readouterr().out
    assert main(["export-hf", str(layout), str(tmp_path / "out")]) == 1  # exists already
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="no such file"):
        export_hf(tmp_path / "missing.gguf", tmp_path / "x", torch.float32)
    assert not (tmp_path / "x").exists()
