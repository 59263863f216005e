"""Turns an EngineConfig into the policies the actors follow."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lever_actors.config import EngineConfig, TreeSpec, default_exit_layer
from lever_actors.device.budget import head_resident_budget
from lever_actors.errors import ConfigError
from lever_actors.model.quantized import QuantizedWeight
from lever_actors.model.transformer import Transformer
from lever_actors.paths import default_cache_dir
from lever_actors.policy.calibration import AcceptanceCalibrator
from lever_actors.policy.cost_model import CostModel
from lever_actors.policy.exit_predictor import LensPredictor, LowRankAdapter
from lever_actors.policy.figures import save_draft_curve
from lever_actors.policy.profile_cache import cached_costs, profile_key
from lever_actors.policy.profiler import profile_costs
from lever_actors.policy.pruning import (
    ProbeWhen,
    PrunePolicy,
    always,
    keep_everything,
    when_compute_bound,
)
from lever_actors.progress import Progress
from lever_actors.sizes import format_bytes
from lever_actors.target import FlashTarget


@dataclass
class Policies:
    spec: TreeSpec
    cost: CostModel | None  # profiled for the gain-cost tree, None otherwise
    calibrator: AcceptanceCalibrator
    exit_layer: int | None  # None: the verifier sends no probes
    prune: PrunePolicy
    probe_when: ProbeWhen  # for a tree of n nodes, whether to consult the pruner
    predictor: str  # which exit predictor prunes: off, probe_only, lens or trained
    eager_projection: bool


def machine_costs(
    config: EngineConfig,
    target: FlashTarget,
    draft: Transformer | None,
    progress: Progress | None = None,
) -> CostModel:
    """The cost model's start: this layout, plan and draft measured on this machine once,
    then read from the cache (policy/profile_cache.py)."""
    directory = default_cache_dir() / "profiles"
    key = profile_key(config, target)
    measured: list[CostModel] = []  # profiled now, not read back

    def profile() -> CostModel:
        measured.append(profile_costs(target, draft, progress))
        return measured[0]

    cost = cached_costs(directory, key, profile)
    if measured and draft is not None and config.draft is not None:
        # later engines' plans price this draft's rounds by it
        save_draft_curve(config, cost.draft)
    return cost


def build_policies(
    config: EngineConfig,
    target: FlashTarget,
    draft: Transformer | None,
    progress: Progress | None = None,
) -> Policies:
    """Blocking: may profile the machine (a second or two) and load a trained predictor."""
    spec = config.tree
    cost = machine_costs(config, target, draft, progress) if spec.sized_by_cost else None
    n_layers = target.args.n_layers
    exit_layer = default_exit_layer(n_layers) if config.exit_layer is None else config.exit_layer
    if not 0 <= exit_layer < n_layers:
        raise ConfigError(f"exit_layer must be in [0, {n_layers}), got {exit_layer}")
    adapter = LowRankAdapter.load(target.store.directory, target.dtype)
    predictor = config.early_exit
    if target.lm_head is None and predictor != "off":
        # the predictors score candidates with rows of the LM head, which then is not in DRAM
        if predictor != "auto":
            holds = format_bytes(head_resident_budget(target.manifest, config.ring_slots))
            raise ConfigError(
                f"early_exit {predictor!r} needs the LM head in DRAM, and the DRAM budget "
                f"streams it (the least that holds it: {holds}); raise dram_budget or set "
                "early_exit off"
            )
        predictor = "off"
    if predictor == "auto":
        predictor = "trained" if adapter is not None else "lens"
    if predictor == "trained":
        if adapter is None:
            raise ConfigError(
                f"early_exit 'trained' needs a predictor beside the target: run "
                f"`lever-actors train-exit {target.store.directory}` first"
            )
        exit_layer = adapter.exit_layer  # the layer it was trained on
    prune: PrunePolicy = keep_everything
    probe_when: ProbeWhen = always
    if predictor in ("lens", "trained"):
        head = target.lm_head  # resident: a streamed one turned the predictor off above
        assert isinstance(head, torch.Tensor | QuantizedWeight)  # a head: never a row table
        prune = LensPredictor(
            target.final_norm,
            head,
            target.args.norm_eps,
            config.prune_threshold,
            adapter if predictor == "trained" else None,
        )
        if cost is not None and config.prune_when == "compute_bound":
            n_layers = target.args.n_layers
            probe_when = when_compute_bound(cost, (n_layers - 1 - exit_layer) / n_layers)
    return Policies(
        spec=spec,
        cost=cost,
        calibrator=AcceptanceCalibrator(),
        exit_layer=None if predictor == "off" else exit_layer,
        prune=prune,
        probe_when=probe_when,
        predictor=predictor,
        # a streamed head is read once per step: every live node projected in that pass
        eager_projection=config.projection == "eager" or target.lm_head is None,
    )
