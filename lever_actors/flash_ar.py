"""Flash-offloaded autoregressive decoding: every token runs the target layer by layer as the
prefetcher streams the layers in (the paper's "baseline flash-offloaded inference")."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import trio

from lever_actors.channels.messages import LayerWeights, SlotRelease
from lever_actors.model.layers import layer_forward
from lever_actors.model.masks import causal_mask
from lever_actors.target import FlashTarget


@dataclass
class FlashARStats:
    tokens: int = 0
    layer_wait_seconds: float = 0.0  # the consumer idle, waiting for the next layer to arrive
    compute_seconds: float = 0.0


async def flash_greedy(
    target: FlashTarget,
    prompt: Sequence[int],
    max_new_tokens: int,
    on_token: Callable[[int], None],
    stop_ids: frozenset[int] = frozenset(),
) -> FlashARStats:
    """Greedy-decode up to `max_new_tokens`, calling `on_token` as each one is produced."""
    stats = FlashARStats()
    prefetcher = target.prefetcher()
    ring = max(target.plan.ring_slots, 1)
    layers_send, layers_recv = trio.open_memory_channel[LayerWeights](ring)
    release_send, release_recv = trio.open_memory_channel[SlotRelease](ring)
    cache = target.new_cache(len(prompt) + max_new_tokens)
    async with trio.open_nursery() as nursery:
        await nursery.start(prefetcher.run, release_recv, layers_send)
        async with layers_recv, release_send:
            pending = list(prompt)
            for _ in range(max_new_tokens):
                n = len(pending)
                positions = torch.arange(cache.length, cache.length + n)
                rope = target.rope.tables(positions, target.dtype)
                mask = causal_mask(cache.length, n)
                x = target.embed(pending)
                for _layer in range(target.args.n_layers):
                    waited = time.perf_counter()
                    weights = await layers_recv.receive()
                    started = time.perf_counter()
                    x = await trio.to_thread.run_sync(
                        layer_forward,
                        x,
                        weights.tensors,
                        target.args,
                        cache,
                        weights.layer,
                        rope,
                        mask,
                    )
                    stats.layer_wait_seconds += started - waited
                    stats.compute_seconds += time.perf_counter() - started
                    if weights.slot is not None:
                        await release_send.send(SlotRelease(weights.slot))
                cache.commit(n)
                token = int(target.logits(x[-1:]).argmax())
                stats.tokens += 1
                on_token(token)
                if token in stop_ids:
                    break
                pending = [token]
    return stats
