"""Decoding modes the benchmark compares. Each decodes one prompt and stamps every token."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import trio

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.flash_ar import flash_greedy
from lever_actors.model.greedy import greedy_stream
from lever_actors.model.transformer import Transformer
from lever_actors.target import FlashTarget


@dataclass
class Decoded:
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # perf_counter() as each token arrived
    bytes_read: int = 0  # from flash, while decoding this prompt

    def add(self, token: int) -> None:
        self.tokens.append(token)
        self.stamps.append(time.perf_counter())


class Mode(Protocol):
    name: str

    def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]
    ) -> Decoded: ...


def stamped(tokens: Iterable[int]) -> Decoded:
    decoded = Decoded()
    for token in tokens:
        decoded.add(token)
    return decoded


class MemoryAR:
    """Ours, the whole target in DRAM, KV-cached greedy: the memory-resident baseline."""

    name = "memory-ar"

    def __init__(self, target: Checkpoint) -> None:
        self.model = Transformer(target.args, target.weights)

    def decode(self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> Decoded:
        return stamped(greedy_stream(self.model, prompt, max_new_tokens, stop_ids))


class FlashAR:
    """Ours, the target streamed from flash layer by layer for every token, under a budget."""

    def __init__(self, layout: Path, budget: int, label: str, throttle: str = "none") -> None:
        self.name = f"flash-ar@{label}"
        self.target = FlashTarget(layout, budget, throttle=throttle)

    def decode(self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> Decoded:
        decoded = Decoded()
        before = self.target.store.stats.bytes_read
        trio.run(flash_greedy, self.target, prompt, max_new_tokens, decoded.add, stop_ids)
        decoded.bytes_read = self.target.store.stats.bytes_read - before
        return decoded


class PeerMemory:
    """transformers' generate on the same GGUF weights, in DRAM (needs the `dev` extra)."""

    name = "peer-memory"

    def __init__(self, gguf_path: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype
        ).eval()

    def decode(self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> Decoded:
        stamps = _StampingStreamer()
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(stop_ids),
                pad_token_id=min(stop_ids),
                streamer=stamps,
            )
        return Decoded(out[0, len(prompt) :].tolist(), stamps.stamps)


class _StampingStreamer:
    """transformers calls put() with the prompt first, then once per generated token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.stamps.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass
