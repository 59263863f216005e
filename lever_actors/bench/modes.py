"""Decoding modes the benchmark compares. Each decodes one prompt and stamps every token."""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import trio

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.model.greedy import greedy_stream
from lever_actors.model.transformer import Transformer


@dataclass
class Decoded:
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # perf_counter() as each token arrived
    bytes_read: int = 0  # from flash, while decoding this prompt
    steps: int = 0  # target passes (verification steps); 0 for modes that have none

    def add(self, token: int) -> None:
        self.tokens.append(token)
        self.stamps.append(time.perf_counter())


class Mode(Protocol):
    name: str

    async def open(self, stack: AsyncExitStack) -> None:
        """Load what the mode needs; anything to close goes on `stack`."""

    async def decode(
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

    async def open(self, stack: AsyncExitStack) -> None:
        pass

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]
    ) -> Decoded:
        stream = greedy_stream(self.model, prompt, max_new_tokens, stop_ids)
        return await trio.to_thread.run_sync(stamped, stream)


class EngineMode:
    """Ours through the actor pipeline: flash-AR (tree "none"), conventional SD, Lever."""

    def __init__(self, name: str, config: EngineConfig, draft: Transformer | None = None) -> None:
        self.name = name
        self.config = config
        self.draft = draft

    async def open(self, stack: AsyncExitStack) -> None:
        self.engine = await stack.enter_async_context(Engine.open(self.config, draft=self.draft))

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]
    ) -> Decoded:
        decoded = Decoded()
        stats = self.engine.target.store.stats
        before = stats.bytes_read
        steps = set()
        async for event in self.engine.stream(prompt, max_new_tokens=max_new_tokens):
            decoded.add(event.token)
            steps.add(event.step)
        decoded.bytes_read = stats.bytes_read - before
        decoded.steps = len(steps)
        return decoded


class PeerMemory:
    """transformers' generate on the same GGUF weights, in DRAM (needs the `dev` extra)."""

    name = "peer-memory"

    def __init__(self, gguf_path: Path, dtype: torch.dtype) -> None:
        self.path = gguf_path
        self.dtype = dtype

    async def open(self, stack: AsyncExitStack) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.path.parent), gguf_file=self.path.name, dtype=self.dtype
        ).eval()

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]
    ) -> Decoded:
        return await trio.to_thread.run_sync(self._generate, prompt, max_new_tokens, stop_ids)

    def _generate(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]
    ) -> Decoded:
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
