"""Early-exit prediction: score tree branches from a hidden state half-way through the target.

Each node's candidate set is its children in the tree plus "shadow" candidates (the draft's
best tokens that did not become children), which stand for the probability mass outside
the tree. Scores are the softmax within that set of the target's own final norm + LM head
rows for just those tokens (a cheap logit lens), optionally after a trained low-rank
adapter. A child whose score falls below the threshold is dropped, with its descendants.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lever_actors.channels.messages import ExitProbe
from lever_actors.errors import CheckpointError
from lever_actors.model.layers import rms_norm
from lever_actors.model.quantized import QuantizedWeight

PREDICTOR_FILE = "exit_predictor.safetensors"


class LowRankAdapter:
    """h -> h + up(down(h)): a light correction of the exit hidden state toward the last."""

    def __init__(self, down: torch.Tensor, up: torch.Tensor, exit_layer: int) -> None:
        self.down = down  # [rank, d_model]
        self.up = up  # [d_model, rank]
        self.exit_layer = exit_layer

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: [n, d_model] -> [n, d_model]"""
        return h + F.linear(F.linear(h, self.down), self.up)

    def save(self, directory: Path) -> Path:
        path = directory / PREDICTOR_FILE
        tensors = {"down": self.down.contiguous(), "up": self.up.contiguous()}
        save_file(tensors, str(path), metadata={"exit_layer": str(self.exit_layer)})
        return path

    @classmethod
    def load(cls, directory: Path, dtype: torch.dtype) -> LowRankAdapter | None:
        path = directory / PREDICTOR_FILE
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                exit_layer = int(f.metadata()["exit_layer"])
            tensors = load_file(str(path))
        except Exception as e:  # safetensors raises its own error types and KeyError
            raise CheckpointError(f"{path}: unreadable exit predictor ({e})") from None
        return cls(tensors["down"].to(dtype), tensors["up"].to(dtype), exit_layer)


class LensPredictor:
    """The pruner's policy: which draft nodes to drop given the exit-layer hidden states."""

    def __init__(
        self,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor | QuantizedWeight,
        eps: float,
        threshold: float,
        adapter: LowRankAdapter | None = None,
    ) -> None:
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.eps = eps
        self.threshold = threshold
        self.adapter = adapter

    def scores(self, hidden: torch.Tensor, candidates: list[int]) -> torch.Tensor:
        """hidden: [d_model] exit state of one node -> [len(candidates)] normalised scores."""
        h = hidden[None]
        if self.adapter is not None:
            h = self.adapter(h)
        h = rms_norm(h, self.final_norm, self.eps)[0]
        ids = torch.tensor(candidates)
        if isinstance(self.lm_head, torch.Tensor):
            logits = self.lm_head[ids] @ h
        else:  # a quantized head
            logits = self.lm_head.products(ids, h)
        return torch.softmax(logits.float(), dim=-1)

    def __call__(self, probe: ExitProbe) -> tuple[int, ...]:
        tree = probe.tree
        row = {node: i for i, node in enumerate(probe.nodes)}
        children: dict[int, list[int]] = {}
        for node in range(tree.n_committed, len(tree.tokens)):
            if node in row and tree.parents[node] in row:
                children.setdefault(tree.parents[node], []).append(node)
        dropped = []
        for parent, kids in children.items():
            candidates = [tree.tokens[k] for k in kids] + list(tree.shadows[parent])
            scores = self.scores(probe.hidden[row[parent]], candidates)
            dropped += [
                k
                for k, score in zip(kids, scores[: len(kids)].tolist(), strict=True)
                if score < self.threshold
            ]
        return tuple(dropped)
