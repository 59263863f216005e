"""How the next token is chosen (`Sampling`): greedy, or seeded sampling at a temperature
with top-k, top-p and min-p filters; model/choosing.py chooses by it. No torch here."""

from __future__ import annotations

import math
import secrets

import msgspec

from lever_actors.errors import ConfigError

MASK64 = (1 << 64) - 1  # a seed's bits
# the least temperature above 0 (greedy): below it a drafter's float32 logits / T drown its
# noise (sampling is greedy in effect), and far below it logits / T overflow to NaN
MIN_TEMPERATURE = 1e-6
_AT_LEAST_MIN = f"0 (greedy) or at least {MIN_TEMPERATURE}"


class Sampling(msgspec.Struct, frozen=True):
    """How the next token is chosen. temperature 0 is greedy (the other fields are unused)."""

    temperature: float = 0.0
    top_k: int = 0  # keep the k likeliest tokens (ties at the k-th kept too); 0: no limit
    top_p: float = 1.0  # keep the likeliest tokens whose probabilities reach p (nucleus)
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one
    seed: int = 0  # the noise's key (`seed_or_drawn` draws one when the user gave none)

    def __post_init__(self) -> None:
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("temperature", self.greedy or self.temperature >= MIN_TEMPERATURE, _AT_LEAST_MIN),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
            ("seed", 0 <= self.seed <= MASK64, f"in [0, {MASK64}]"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r}: expected {expected}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def reported_seed(self) -> int | None:
        """The seed as results report it: None when greedy, where it decides nothing."""
        return None if self.greedy else self.seed


GREEDY = Sampling()


def seed_or_drawn(seed: int | None) -> int:
    """`seed`, or a freshly drawn one when the user gave none."""
    return secrets.randbits(63) if seed is None else seed
