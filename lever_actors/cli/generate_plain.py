"""`generate --plan ar` or `lookup` without torch (#63): where the target's layout is
converted (on a first run, first: only that loads torch), its model one the plain path runs
(model/plain_model.py), and the target fits in DRAM beside its context under the memory plan
(its embedding table's rows read from flash where the table does not), the command reads
the target and decodes on our plain kernels, one token a pass or with copies from the text
verified beside it, the same tokens the engine gives, and never imports torch. Anything
else goes to the engine; plan/plain.py decides, and -v says why."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import msgspec

from lever_actors.checkpoints.fetch import REAL_MODELS
from lever_actors.checkpoints.layout_cache import is_current, is_gguf, layout_path
from lever_actors.checkpoints.tokenizer import Tokenizer, layout_tokenizer
from lever_actors.cli.engine_options import engine_flags
from lever_actors.cli.generate_output import Summary, streamed
from lever_actors.config import EngineConfig, check_request_size
from lever_actors.device.manifest import Manifest, read_manifest
from lever_actors.device.memory import return_freed_heap
from lever_actors.errors import ConfigError
from lever_actors.logs import get_logger
from lever_actors.model.plain_model import token_stream
from lever_actors.options import GenerationOptions
from lever_actors.paths import file_inside
from lever_actors.plain_target import PlainTarget
from lever_actors.plan.plain import (
    PlainPlan,
    plain_context,
    plain_memory,
    refusal,
    tokenizer_peak_bytes,
)
from lever_actors.policy.plain_copies import CopyProposer
from lever_actors.sizes import format_bytes
from lever_actors.threads import settle_policy

log = get_logger(__name__)


class TargetLoad:
    """The plain target read on a thread of its own from construction on, so that the
    tokenizer may parse meanwhile; `result` waits for it."""

    def __init__(self, layout: Path, *, embed_resident: bool, verify: bool) -> None:
        self.started = time.perf_counter()
        self.embed_resident = embed_resident
        pool = ThreadPoolExecutor(1, thread_name_prefix="plain-load")
        self._target = pool.submit(
            PlainTarget, layout, embed_resident=embed_resident, verify=verify
        )
        pool.shutdown(wait=False)  # its thread ends with the load

    def result(self) -> PlainTarget:
        """Blocking: the target, once read and checked (its load's error, if it failed)."""
        return self._target.result()

    def discard(self) -> None:
        """Blocking: the target, once read, let go of (the engine runs the request instead)."""
        if self._target.exception() is None:
            self._target.result().close()


class PlainRun(NamedTuple):
    """What the plain path runs: the layout, its manifest and tokenizer, the plan, and the
    target's load where it began beside the tokenizer's parse (else None)."""

    layout: Path
    manifest: Manifest
    config: EngineConfig
    tokenizer: Tokenizer
    plan: PlainPlan
    load: TargetLoad | None


def plain_run(args: argparse.Namespace, options: GenerationOptions) -> PlainRun | None:
    """What `generate` runs without torch, or None (and why, logged under -v) where the
    engine must run it (plan/plain.py decides)."""
    run, why = _run_and_why(args, options)
    if run is None:
        return_freed_heap()  # a tokenizer read for the plan: the engine reads its own
        log.info(f"generate runs on the engine: {why}")
    return run


def _run_and_why(
    args: argparse.Namespace, options: GenerationOptions
) -> tuple[PlainRun | None, str]:
    if args.model is not None:
        return None, "--model holds a model in DRAM on torch"
    layout = _converted(args) or _converted_now(args)
    if layout is None:
        return None, "the target's layout is not current"
    manifest = read_manifest(layout)
    draft = _draft(args)
    try:
        config = EngineConfig(target=str(layout), draft=draft, **engine_flags(args))
    except ConfigError as error:  # the engine's config (the draft's flags) says what is wrong
        return None, str(error)
    why = refusal(config, manifest)
    if why:
        return None, why
    load = _load_beside_the_parse(config, manifest, layout, args.verify)
    run: PlainRun | None = None
    try:
        run, why = _after_the_parse(layout, manifest, config, load)
        return run, why
    finally:
        if run is None and load is not None:  # the engine's after all, or the parse failed
            load.discard()


def _after_the_parse(
    layout: Path, manifest: Manifest, config: EngineConfig, load: TargetLoad | None
) -> tuple[PlainRun | None, str]:
    tokenizer = layout_tokenizer(layout, manifest)  # before the plan, which counts it
    if tokenizer is None:
        return None, "the layout has no tokenizer"
    return_freed_heap()  # the parse's temporaries: 100 MiB of the real target's 146
    placed = load.result().bytes_read if load else 0
    plan, why = plain_memory(config, manifest, placed=placed)
    if plan is None:
        return None, why
    if load is not None:  # its table stays as it was read, resident or from flash
        plan = plan._replace(embed_resident=load.embed_resident)
    return PlainRun(layout, manifest, config, tokenizer, plan, load), ""


def _load_beside_the_parse(
    config: EngineConfig, manifest: Manifest, layout: Path, verify: bool
) -> TargetLoad | None:
    """The target's load, begun now, where the limit holds the whole target beside the
    tokenizer's parse at its peak (the real pair's first token 0.5 s sooner); else None,
    and the target loads once the tokenizer is in."""
    if manifest.tokenizer is None:
        return None
    json = file_inside(layout, manifest.tokenizer, "manifest tokenizer")
    plan, _ = plain_memory(config, manifest, coming=tokenizer_peak_bytes(json))
    if plan is None:
        return None
    return TargetLoad(layout, embed_resident=plan.embed_resident, verify=verify)


def _draft(args: argparse.Namespace) -> str | None:
    """The draft the engine would load: --draft's, else with the real target the real
    draft (an auto plan weighs whether it fits beside the whole target)."""
    if args.draft is not None:
        return str(args.draft)
    return str(args.cache_dir / REAL_MODELS["draft"].file_name) if args.target is None else None


def _converted(args: argparse.Namespace) -> Path | None:
    """The target's layout, where it is there and current: --target's, or the real
    target's."""
    if args.target is None:
        gguf = Path(REAL_MODELS["target"].file_name)
        layout = layout_path(gguf, args.cache_dir, args.target_weights, name=gguf.stem)
    elif is_gguf(args.target):
        layout = layout_path(args.target, args.cache_dir, args.target_weights)
    else:
        layout = args.target
    return layout if is_current(layout) else None


def _converted_now(args: argparse.Namespace) -> Path | None:
    """The real target, or a GGUF --target, fetched and converted now, so that a first run
    takes the plain path as later ones do: torch loads for the conversion alone, whose
    products run on a thread that ends (checkpoints/gguf_layout.py). None for a layout
    directory that is not current (the engine says why)."""
    if args.target is not None and not is_gguf(args.target):
        return None
    settle_policy()  # OpenMP loads with torch
    importlib.import_module("lever_actors.cli.engine_config").engine_config(args)
    return_freed_heap()  # the conversion's temporaries, before the plan counts the process
    return _converted(args)


def generate_plain(
    run: PlainRun,
    args: argparse.Namespace,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
) -> Summary:
    """The request decoded on the plain path (greedy or seeded), streamed to stdout."""
    load = run.load or TargetLoad(
        run.layout, embed_resident=run.plan.embed_resident, verify=args.verify
    )
    target = load.result()
    try:
        return _decode(target, run, prompt, messages, options, load.started)
    finally:
        target.close()


def _decode(
    target: PlainTarget,
    run: PlainRun,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
    started: float,
) -> Summary:
    tokenizer, model = run.tokenizer, target.model
    context = plain_context(run.config, run.manifest)
    text = prompt if messages is None else tokenizer.apply_chat_template(messages)
    assert text is not None  # a prompt or messages
    ids = tokenizer.encode(text)
    check_request_size(len(ids), options.max_new_tokens, context.tokens, context.why)
    loaded = time.perf_counter() - started
    rows = "" if run.plan.embed_resident else ", the embedding's rows read from flash"
    print(
        f"loaded in {loaded:.1f} s, without torch; {context}; "
        f"{format_bytes(target.bytes_read)} of target weights in DRAM "
        f"({target.reader.mode}{rows})",
        file=sys.stderr,
    )
    print(run.plan.memory, file=sys.stderr)
    chosen = " (auto: the whole target in DRAM)" if run.config.plan == "auto" else ""
    print(f"plan: {run.plan.name} on the plain kernels, without torch{chosen}", file=sys.stderr)
    read_before = target.reader.stats.bytes_read
    copies = CopyProposer(run.plan.copies) if run.plan.copies else None
    stream = token_stream(
        model, ids, options.max_new_tokens, tokenizer.eos_ids, options.sampling, copies
    )
    summary = streamed(stream, tokenizer, ids, options)
    read = target.reader.stats.bytes_read - read_before  # the embedding's rows, if streamed
    steps = copies.passes if copies else summary.generated_tokens
    return msgspec.structs.replace(
        summary,
        steps=steps,
        tokens_per_step=summary.generated_tokens / max(steps, 1),
        from_draft=copies.taken if copies else 0,
        bytes_read_per_token=read // max(summary.generated_tokens, 1),
        load_seconds=loaded,
    )
