"""A 12-layer bf16 pair (width 512, vocab 8000, the target a noisy copy of the draft) at a
25% DRAM budget: the engine against one-token greedy of the same bf16 layout, 40 tokens on
3 prompts, a few runs per policy. Prints, per run and prompt, the first differing token
(None: exact) and the largest tree verified.

    PYTHONPATH=CHECKOUT .venv/bin/python benchmarks/tiny_bf16_divergence.py [RUNS] [WORKDIR]

Run it against two checkouts (PYTHONPATH) to compare their kernels on the same models.
"""

import sys
from pathlib import Path

import msgspec
import torch
import trio

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.model.sequential import sequential_cached
from lever_actors.model.transformer import Transformer
from lever_actors.testing import bf16_args, write_perturbed_copy, write_tiny_checkpoint

# the tests' bf16 config, deeper, wider in the feed-forward and with the issue's vocabulary
ARGS = msgspec.structs.replace(
    bf16_args(), vocab_size=8000, n_layers=12, ffn_dim=1536, max_seq_len=1024
)
PROMPTS = [[(i * 7 + 3) % 50 for i in range(24)], [5, 6, 7, 8] * 6, list(range(100, 140))]
NEW_TOKENS = 40
POLICIES = [  # tree, draft ahead, flash profile
    ("static:8,8", False, "none"),
    ("gaincost", True, "none"),
    ("gaincost", True, "ufs3.1"),
    ("gaincost", False, "none"),
    ("static:4,2,2,1", False, "none"),
]


async def first_differences(config: EngineConfig, expected: list[list[int]]) -> list[tuple]:
    found = []
    async with Engine.open(config) as engine:
        for prompt, want in zip(PROMPTS, expected, strict=True):
            result = await engine.generate(prompt, max_new_tokens=NEW_TOKENS)
            pairs = zip(result.tokens, want, strict=False)
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            found.append((first, max(s.tree_nodes for s in result.steps)))
    return found


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    root = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/tiny12")
    if not (root / "layout").is_dir():
        write_tiny_checkpoint(root / "draft", ARGS, seed=5)
        write_perturbed_copy(root / "draft", root / "target", seed=6, scale=0.02)
        convert(root / "target", root / "layout", torch.bfloat16)
    checkpoint = load_checkpoint(root / "layout", torch.bfloat16)
    reference = Transformer(checkpoint.args, checkpoint.weights)
    expected = [sequential_cached(reference, p, NEW_TOKENS) for p in PROMPTS]
    for tree, ahead, throttle in POLICIES:
        config = EngineConfig(
            target=str(root / "layout"),
            draft=str(root / "draft"),
            tree=tree,
            dram_budget="25%",
            draft_ahead=ahead,
            throttle=throttle,
        )
        for run in range(runs):
            found = trio.run(first_differences, config, expected)
            print(f"{tree:15} ahead={ahead!s:5} {throttle:7} run {run}: {found}", flush=True)


if __name__ == "__main__":
    main()
