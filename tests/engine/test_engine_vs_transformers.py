"""The engine, speculating or not, emits exactly what transformers' own greedy `generate`
emits, on tiny float64 checkpoints saved by transformers (tests/tiny_hf.py) and on those
lever_actors.testing writes itself."""

from __future__ import annotations

import msgspec
import pytest
import torch
import transformers

from lever_actors.checkpoints.convert import convert
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.model.args import RopeScaling
from lever_actors.testing import budget_bytes, write_perturbed_copy, write_tiny_checkpoint
from lever_actors.testing.checkpoints import TINY_ARGS
from tests.tiny_hf import ARCHS, full_precision_norms, save_tiny, tiny_model

PROMPT = [3, 14, 15, 92, 65, 35, 3, 14]
NEW_TOKENS = 24

# name -> engine settings; "least" is the smallest DRAM budget the engine accepts
SETTINGS = {
    "flash-ar": dict(tree="none", budget="least"),
    "chain-1": dict(tree="chain:1", budget="all", early_exit="off"),
    "chain-4": dict(tree="chain:4", budget="least", early_exit="off"),
    "chain-4-lens": dict(tree="chain:4", budget=0.5, early_exit="lens", prune_threshold=0.3),
    "static-3-2-1": dict(tree="static:3,2,1", budget="least", early_exit="probe_only"),
    "static-2-2-2-lens": dict(
        tree="static:2,2,2", budget="all", early_exit="lens", prune_threshold=0.2
    ),
    "static-4-eager": dict(tree="static:4,1", budget=0.3, early_exit="off", projection="eager"),
    "gaincost": dict(tree="gaincost:16", budget="least"),
}


def their_greedy(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with full_precision_norms(), torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=ARCHS)
def saved(request, tmp_path_factory):
    """transformers' checkpoint as a flash layout, a perturbed copy as the draft, and what
    transformers generates."""
    root = tmp_path_factory.mktemp(request.param)
    theirs = tiny_model(request.param, layers=4)
    checkpoint = save_tiny(theirs, root / "hf")
    layout = root / "flash"
    convert(checkpoint, layout, torch.float64)
    draft = write_perturbed_copy(checkpoint, root / "draft", seed=7, scale=0.01)
    return layout, checkpoint, draft, their_greedy(theirs, PROMPT, NEW_TOKENS)


def engine_config(layout, draft, *, budget, **settings) -> EngineConfig:
    dram = budget_bytes(layout, 0.0 if budget == "least" else budget)
    return EngineConfig(
        target=str(layout), draft=str(draft), dram_budget=dram, draft_dtype="float64", **settings
    )


@pytest.mark.parametrize("draft_kind", ["perturbed", "identical"])
@pytest.mark.parametrize("setting", list(SETTINGS))
async def test_engine_equals_transformers_generate(saved, setting, draft_kind):
    layout, checkpoint, perturbed, expected = saved
    draft = perturbed if draft_kind == "perturbed" else checkpoint
    async with Engine.open(engine_config(layout, draft, **SETTINGS[setting])) as engine:
        result = await engine.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert result.tokens == expected
    if SETTINGS[setting]["tree"].startswith(("chain", "static")):
        assert result.mean_accepted > 1  # the draft really was speculating
    # (gain-cost may rightly decline to draft: here the draft costs as much as the target)


# TINY_ARGS widened: a vocabulary past PROMPT's ids, and 4 heads of 8 dims over 2 kv heads,
# wider than d_model, so that the config must say head_dim
WRITTEN_SIZES = dict(vocab_size=97, d_model=24, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=40)
WRITTEN = [
    pytest.param(arch, tie, rope, id=f"{arch}{'-tied' if tie else ''}{'-linear' if rope else ''}")
    for arch, tie, rope in [
        ("llama", False, None),
        ("llama", True, RopeScaling(kind="linear", factor=2.0)),
        ("qwen2", False, None),
        ("qwen2", True, None),
        ("qwen3", False, None),
        ("qwen3", True, RopeScaling(kind="linear", factor=2.0)),
    ]
]


@pytest.mark.parametrize(("arch", "tie", "rope"), WRITTEN)
async def test_written_tiny_checkpoints_load_in_transformers_and_agree(arch, tie, rope, tmp_path):
    """Our checkpoint writer speaks transformers' format: names, config and RoPE settings."""
    args = msgspec.structs.replace(
        TINY_ARGS, arch=arch, tie_embeddings=tie, rope_scaling=rope, rope_theta=5e5, **WRITTEN_SIZES
    )
    checkpoint = write_tiny_checkpoint(tmp_path / "hf", args, seed=3)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    expected = their_greedy(theirs.eval(), PROMPT, NEW_TOKENS)
    layout = tmp_path / "flash"
    convert(checkpoint, layout, torch.float64)
    draft = write_perturbed_copy(checkpoint, tmp_path / "draft", seed=4, scale=0.01)
    config = engine_config(layout, draft, budget="least", tree="static:2,2,1", early_exit="off")
    async with Engine.open(config) as engine:
        result = await engine.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert result.tokens == expected
