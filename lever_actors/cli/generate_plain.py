"""`generate --plan ar` without torch (#63): where the target's layout is converted, its
model one the plain path runs (model/plain_model.py), the request greedy, and the target
fits in DRAM beside its context under the memory plan (its embedding table's rows read from
flash where the table does not), the command reads the target and decodes one token a
pass on our plain kernels, the same tokens the engine's
`ar` gives, and never imports torch. Anything else goes to the engine (`plain_layout` says
why, under -v)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

from lever_actors.channels.stats import decode_rate
from lever_actors.checkpoints.fetch import REAL_MODELS
from lever_actors.checkpoints.layout_cache import is_current, is_gguf, layout_path
from lever_actors.checkpoints.tokenizer import Tokenizer, layout_tokenizer
from lever_actors.cli.engine_options import engine_flags
from lever_actors.cli.generate_output import Summary, TextPrinter
from lever_actors.config import EngineConfig, check_request_size
from lever_actors.device.manifest import DTYPE_SIZES, Manifest, read_manifest
from lever_actors.device.memory import peak_rss_bytes, return_freed_heap
from lever_actors.errors import ConfigError
from lever_actors.logs import get_logger
from lever_actors.model import kernel_build
from lever_actors.model.plain_model import greedy, unsupported
from lever_actors.model.shapes import position_bytes
from lever_actors.options import GenerationOptions
from lever_actors.plain_target import PlainTarget, embed_bytes, plain_formats
from lever_actors.plan.context import plan_context
from lever_actors.plan.memory import MemoryPlan, memory_plan, read_process
from lever_actors.sizes import format_bytes
from lever_actors.text.finish import finish_reason

log = get_logger(__name__)

# flags whose work only the engine does: a plain run would ignore them
ENGINE_ONLY = ("trace", "prompt_cache_dir", "model")


class PlainPlan(NamedTuple):
    layout: Path
    manifest: Manifest
    tokenizer: Tokenizer
    memory: MemoryPlan  # room for a context beside the target
    embed_resident: bool  # else the embedding table's rows are read from flash


def plain_plan(args: argparse.Namespace, options: GenerationOptions) -> PlainPlan | None:
    """What `generate` runs without torch, or None (and why, logged under -v) where the
    engine must run it."""
    plan, why = _plan_and_why(args, options)
    if plan is None:
        return_freed_heap()  # a tokenizer read for the plan: the engine reads its own
        log.info(f"generate runs on the engine: {why}")
    return plan


def _plan_and_why(
    args: argparse.Namespace, options: GenerationOptions
) -> tuple[PlainPlan | None, str]:
    if args.plan != "ar":
        return None, "only --plan ar runs without torch"
    if not options.sampling.greedy:
        return None, "seeded sampling draws torch's noise"
    given = [f"--{name.replace('_', '-')}" for name in ENGINE_ONLY if getattr(args, name, None)]
    if given or args.throttle != "none" or args.dram_budget is not None:
        return None, f"{', '.join(given) or '--throttle or --dram-budget'} asks for the engine"
    layout = _converted(args)
    if layout is None:
        return None, "the target is not converted yet"
    manifest = read_manifest(layout)
    why = unsupported(manifest.args) or plain_formats(manifest)
    if why:
        return None, why
    isa, why = kernel_build.supported((kernel_build.AVX512_VNNI, kernel_build.AVX2))
    if isa is None:
        return None, why
    if kernel_build.supported()[0] is kernel_build.AMX and _has_integer_matrices(manifest):
        return None, "AMX's tiles multiply int4 and int8 matrices by x unrounded, as ours do not"
    tokenizer = layout_tokenizer(layout, manifest)  # before the plan, which counts it
    if tokenizer is None:
        return None, "the layout has no tokenizer"
    return_freed_heap()  # the parse's temporaries: 100 MiB of the real target's 146
    config = EngineConfig(target=str(layout), draft=None, **engine_flags(args))
    try:  # room for the context the request may fill beside the target
        memory = memory_plan(config, manifest, read_process(), draft=0)
    except ConfigError as error:
        return None, str(error)
    if memory.budget < manifest.file_bytes - embed_bytes(manifest):
        return None, f"{memory}: the layers and the LM head would stream"
    embed_resident = memory.budget >= manifest.file_bytes
    return PlainPlan(layout, manifest, tokenizer, memory, embed_resident), ""


def _has_integer_matrices(manifest: Manifest) -> bool:
    return any(t.format in ("int4", "int8") for e in manifest.extents for t in e.tensors)


def _converted(args: argparse.Namespace) -> Path | None:
    """The target's layout, where it is there and current (the engine converts one that
    is not): --target's, or the real target's."""
    if args.target is None:
        gguf = Path(REAL_MODELS["target"].file_name)
        layout = layout_path(gguf, args.cache_dir, args.target_weights, name=gguf.stem)
    elif is_gguf(args.target):
        layout = layout_path(args.target, args.cache_dir, args.target_weights)
    else:
        layout = args.target
    return layout if is_current(layout) else None


def generate_plain(
    plan: PlainPlan,
    args: argparse.Namespace,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
) -> Summary:
    """The request decoded greedily on the plain path, streamed to stdout."""
    started = time.perf_counter()
    target = PlainTarget(plan.layout, embed_resident=plan.embed_resident, verify=args.verify)
    try:
        return _decode(target, plan, args, prompt, messages, options, started)
    finally:
        target.close()


def _decode(
    target: PlainTarget,
    plan: PlainPlan,
    args: argparse.Namespace,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
    started: float,
) -> Summary:
    tokenizer, model = plan.tokenizer, target.model
    reading = read_process()
    kv_bytes = position_bytes(model.args, DTYPE_SIZES[plan.manifest.dtype])
    context = plan_context(
        args.ctx_size, model.args.max_seq_len, kv_bytes, reading.limit, reading.process
    )
    text = prompt if messages is None else tokenizer.apply_chat_template(messages)
    assert text is not None  # a prompt or messages
    ids = tokenizer.encode(text)
    check_request_size(len(ids), options.max_new_tokens, context.tokens, context.why)
    loaded = time.perf_counter() - started
    rows = "" if plan.embed_resident else ", the embedding's rows read from flash"
    print(
        f"loaded in {loaded:.1f} s, without torch; {context}; "
        f"{format_bytes(target.bytes_read)} of target weights in DRAM "
        f"({target.reader.mode}{rows})",
        file=sys.stderr,
    )
    print(plan.memory, file=sys.stderr)
    print("plan: ar on the plain kernels (no torch)", file=sys.stderr)
    printer = TextPrinter(tokenizer, ids)
    cache = model.new_cache(len(ids) + options.max_new_tokens)
    tokens: list[int] = []
    pending, first = ids, started
    decoding = time.perf_counter()
    while len(tokens) < options.max_new_tokens:
        hidden = model.forward(pending, cache)
        cache.commit(len(pending))
        [token] = greedy(model.logits(hidden[-1:]))
        if not tokens:
            first = time.perf_counter()
        tokens.append(token)
        printer.push(token)
        if token in tokenizer.eos_ids:
            break
        pending = [token]
    printer.close()
    ended = finish_reason(
        end_token=tokens[-1] in tokenizer.eos_ids,
        generated=len(tokens),
        max_new_tokens=options.max_new_tokens,
    )
    return Summary(
        prompt_tokens=len(ids),
        generated_tokens=len(tokens),
        finish_reason=ended,
        first_token_seconds=first - decoding,
        prefill_tokens_per_second=decode_rate(len(ids), first - decoding),
        decode_tokens_per_second=decode_rate(len(tokens) - 1, time.perf_counter() - first),
        peak_rss_bytes=peak_rss_bytes(),
        seed=None,
        steps=len(tokens),
        tokens_per_step=1.0,
        from_draft=0,
        bytes_read_per_token=0,
        load_seconds=loaded,
    )
