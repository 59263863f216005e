"""Measures this machine's step costs at engine start, to seed the cost model."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from lever_actors.device.budget import head_key
from lever_actors.device.manifest import layer_key
from lever_actors.device.reads import AlignedBuffer
from lever_actors.model.layers import layer_forward
from lever_actors.model.placement import chain_placement
from lever_actors.model.transformer import Transformer
from lever_actors.model.weights import LayerTensors
from lever_actors.policy.cost_model import CostModel, Curve
from lever_actors.progress import Progress
from lever_actors.target import FlashTarget

VERIFY_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
DRAFT_SIZES = [1, 2, 4, 8, 16, 32]
CONTEXT = 64  # committed positions the probe attends to, like a short prompt
BANDWIDTH_READS = 4


def profile_costs(
    target: FlashTarget, draft: Transformer | None, progress: Progress | None = None
) -> CostModel:
    total = len(VERIFY_SIZES) + (len(DRAFT_SIZES) if draft else 0) + 2
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:  # measured once per machine, layout and draft (profile_cache.py)
            progress(done, total, "measuring this machine's step costs (once)")

    layer, bandwidth = _one_layer(target)
    _target_layer(target, layer, 2)  # the first call pays one-off set-up costs
    if draft:
        _draft_forward(draft, 2)
    tick()
    verify = []
    for n in VERIFY_SIZES:
        verify.append(_best_time(partial(_target_layer, target, layer, n)) * target.args.n_layers)
        tick()
    drafting = []
    if draft:
        for n in DRAFT_SIZES:
            drafting.append(_best_time(partial(_draft_forward, draft, n)))
            tick()
    # each pass reads the head once, whatever its rows (from flash where it streams, else
    # from DRAM): 8 rows against 1 tell the products per node apart from the read
    hidden = torch.zeros(1, target.args.d_model, dtype=target.dtype)
    one = _best_time(lambda: target.logits(hidden))
    eight = _best_time(lambda: target.logits(hidden.expand(8, -1)))
    project = max((eight - one) / 7, 0.0)
    head_pass, head_bytes = one - project, 0
    if target.lm_head is None:  # the read is priced from the flash bandwidth
        head_pass, head_bytes = 0.0, target.manifest.extent(head_key(target.manifest)).nbytes
    tick()
    streamed = sum(target.manifest.layer(i).nbytes for i in target.plan.streamed_layers)
    return CostModel(
        flash_bandwidth=bandwidth,
        streamed_bytes=streamed,
        verify=Curve(list(VERIFY_SIZES), verify),
        draft=Curve(list(DRAFT_SIZES), drafting) if draft else Curve([1], [0.0]),
        project_seconds=project,
        head_pass_seconds=head_pass,
        head_bytes=head_bytes,
    )


def _one_layer(target: FlashTarget) -> tuple[LayerTensors, float]:
    """A layer's weights to compute with, and the bandwidth seen reading a few streamed
    layers back to back from flash (one read alone is too noisy to trust)."""
    streamed = target.plan.streamed_layers
    if not streamed:
        return target.resident_layers[0], float("inf")
    extents = [target.manifest.extent(layer_key(i)) for i in streamed[:BANDWIDTH_READS]]
    buffer = AlignedBuffer(max(e.nbytes for e in extents))
    started = time.perf_counter()
    for extent in extents:
        weights = target.store.read_extent(extent, buffer)
    seconds = time.perf_counter() - started
    return weights, sum(e.nbytes for e in extents) / seconds


def _target_layer(target: FlashTarget, weights: LayerTensors, n: int) -> None:
    cache = target.new_cache(CONTEXT + n)
    cache.commit(CONTEXT)
    x = torch.zeros(n, target.args.d_model, dtype=target.dtype)
    with torch.inference_mode():
        layer_forward(
            x,
            weights,
            target.args,
            cache,
            0,
            chain_placement(target.rope, CONTEXT, n, target.dtype),
        )


def _draft_forward(draft: Transformer, n: int) -> None:
    cache = draft.new_cache(CONTEXT + n)
    cache.commit(CONTEXT)
    hidden = draft.forward(torch.zeros(n, dtype=torch.int64), cache)
    draft.logits(hidden)


def _best_time(fn: Callable[[], object], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best
