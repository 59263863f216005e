"""Seeded random pauses that actors take between steps, to fuzz their interleaving."""

from __future__ import annotations

import random

import trio


class Jitter:
    def __init__(self, max_seconds: float, seed: int) -> None:
        self.max_seconds = max_seconds
        self.rng = random.Random(seed)

    async def __call__(self) -> None:
        if self.max_seconds > 0:
            await trio.sleep(self.rng.uniform(0, self.max_seconds))
