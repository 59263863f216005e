"""Every message that crosses a channel between actors. Tensors ride in-process only."""

from __future__ import annotations

from typing import Any

import msgspec


class Message(msgspec.Struct, frozen=True, tag=True):
    """Shared tagged base: the tag names the type in traces."""


class LayerWeights(Message, frozen=True):
    """prefetcher -> verifier: one layer's tensors for pass `pass_index`, resident or in a slot."""

    layer: int
    pass_index: int
    tensors: dict[str, Any]  # views into a ring slot: valid until that slot is released
    slot: int | None  # None for a resident layer, which needs no release


class SlotRelease(Message, frozen=True):
    """verifier -> prefetcher: the layer in this ring slot is done; the slot may be refilled."""

    slot: int
