"""`train-exit`: the distilled exit predictor beats the plain lens on held-out text, is saved
where the engine finds it, and an engine pruning with it still emits exact greedy tokens."""

from __future__ import annotations

import pytest
import torch

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.cli import main
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.model.sequential import sequential_reference
from lever_actors.model.transformer import Transformer
from lever_actors.policy.exit_predictor import LowRankAdapter
from lever_actors.policy.exit_training import (
    collect_hidden_states,
    predictor_path,
    save_adapter,
    train_exit_predictor,
)
from lever_actors.testing import write_tiny_tokenizer
from tests.tiny_hf import save_tiny, tiny_model

VOCAB = 97
EXIT_LAYER = 1  # not the engine's default (the middle, 2): the saved layer must win
PROMPT = [3, 14, 15, 92, 65]
TRAINING = dict(exit_layer=EXIT_LAYER, rank=8, steps=300, lr=1e-2, continue_tokens=8, seed=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A float64 target layout (with a word-level tokenizer) and a draft near the target."""
    root = tmp_path_factory.mktemp("exit")
    hf = save_tiny(tiny_model("qwen2", layers=4), root / "target")
    write_tiny_tokenizer(hf, VOCAB)
    draft = tiny_model("qwen2", layers=4)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    layout = root / "layout"
    convert(hf, layout, torch.float64)
    return layout, save_tiny(draft, root / "draft")


def random_texts(n: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for _ in range(n)]


def linked_copy(layout, directory):
    """A layout directory of our own (the predictor goes in it) sharing the files."""
    directory.mkdir()
    for f in layout.iterdir():
        (directory / f.name).symlink_to(f)
    return directory


@pytest.fixture(scope="module")
def trained(models):
    layout, _ = models
    return train_exit_predictor(layout, random_texts(24, 16, seed=0), **TRAINING)


def test_packed_collection_equals_one_sequence_at_a_time(models):
    layout, _ = models
    checkpoint = load_checkpoint(layout, torch.float64)
    model = Transformer(checkpoint.args, checkpoint.weights)
    texts = [PROMPT, [7, 8], [50, 51, 52, 53, 54, 55, 56]]
    _, finals = collect_hidden_states(checkpoint, texts, EXIT_LAYER, continue_tokens=5)
    for text, final in zip(texts, finals, strict=True):
        continuation = sequential_reference(model, text, 5)
        full = text + continuation
        assert model.logits(final[len(text) - 1 : -1]).argmax(-1).tolist() == continuation
        expected = model.forward(torch.tensor(full), model.new_cache(len(full)))
        torch.testing.assert_close(final, expected, rtol=1e-10, atol=1e-10)


def test_training_lowers_heldout_kd_loss_below_the_plain_lens(trained):
    _, report = trained
    assert report.heldout_positions > 0 and report.train_positions > report.heldout_positions
    assert report.trained_loss < 0.9 * report.lens_loss, report
    assert report.trained_train_loss < report.lens_train_loss


def test_training_is_deterministic(models):
    layout, _ = models
    short = {**TRAINING, "steps": 30, "seed": 5}
    (a, report), (b, again) = (
        train_exit_predictor(layout, random_texts(8, 12, seed=1), **short) for _ in range(2)
    )
    assert torch.equal(a.down, b.down) and torch.equal(a.up, b.up)
    assert report.trained_loss == again.trained_loss


async def test_saved_predictor_is_picked_up_and_output_stays_exact(models, trained, tmp_path):
    layout, draft = models
    adapter, _ = trained
    target = linked_copy(layout, tmp_path / "layout")
    path = save_adapter(adapter, predictor_path(target))
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(".")) == []
    loaded = LowRankAdapter.load(target, torch.float32)
    assert loaded.exit_layer == EXIT_LAYER and path.is_file()
    assert torch.equal(loaded.down, adapter.down) and torch.equal(loaded.up, adapter.up)

    checkpoint = load_checkpoint(layout, torch.float64)
    expected = sequential_reference(Transformer(checkpoint.args, checkpoint.weights), PROMPT, 16)
    config = EngineConfig(
        target=str(target),
        draft=str(draft),
        tree="chain:3",
        early_exit="trained",
        prune_threshold=0.3,  # aggressive, so that the trained predictor does prune here
        draft_dtype="float64",
    )
    async with Engine.open(config) as engine:
        assert engine.policies.predictor == "trained"
        assert engine.policies.exit_layer == EXIT_LAYER
        assert engine.policies.prune.adapter is not None
        result = await engine.generate(PROMPT, max_new_tokens=16)
    assert result.tokens == expected
    assert sum(step.pruned for step in result.steps) > 0


def test_cli_trains_on_prompts_and_saves_beside_the_layout(models, tmp_path, monkeypatch, capsys):
    layout, _ = models
    target = linked_copy(layout, tmp_path / "layout")
    words = [" ".join(f"t{t}" for t in text) for text in random_texts(4, 12, seed=3)]

    def fake_prompts(name, cache_dir, count, seed):
        assert (name, count) == ("sharegpt", 4)
        return words[:count]

    monkeypatch.setattr("lever_actors.cli.tools.load_prompts", fake_prompts)
    argv = ["train-exit", str(target), "--prompt-set", "sharegpt", "--prompts", "4"]
    argv += ["--exit-layer", "2", "--rank", "4", "--steps", "20", "--continue-tokens", "4"]
    assert main(argv) == 0
    assert "held-out KD loss" in capsys.readouterr().out
    assert LowRankAdapter.load(target, torch.float64).exit_layer == 2
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(".")) == []
