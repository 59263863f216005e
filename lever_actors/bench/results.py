"""The benchmark's results files: msgspec Structs, validated when read back.

A figure that cannot be computed (a failed mode, a mode without target passes) is None,
written as null or left out, never NaN: every float in a file is finite.
"""

from __future__ import annotations

import math
import os
import platform
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import msgspec

from lever_actors.bench.isolation import probe_cgroup
from lever_actors.channels.stats import decode_rate
from lever_actors.device.disk_profile import DiskProfile
from lever_actors.errors import LeverError
from lever_actors.machine import cpu_name

SCHEMA_VERSION = 2


class ResultsError(LeverError, ValueError):
    """A results file is missing, corrupted, or not of this schema."""


class Machine(msgspec.Struct, frozen=True):
    cpu: str
    cores: int
    torch_version: str
    python_version: str
    date: str
    memory_bytes: int = 0  # physical memory
    cgroup: str = ""  # what memory isolation this machine offers (bench/isolation.py)
    disk_bandwidth: float | None = None  # raw sequential read bytes/s, measured in the run

    @classmethod
    def here(cls) -> Machine:
        return cls(
            cpu=cpu_name(),
            cores=os.cpu_count() or 0,
            torch_version=version("torch"),  # without importing it
            python_version=platform.python_version(),
            date=datetime.now(UTC).strftime("%Y-%m-%d"),
            memory_bytes=_memory_bytes(),
            cgroup=probe_cgroup().describe(),
        )


class ModeInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one mode is and the memory it ran under."""

    name: str  # e.g. "lever@25%", "sd-chain:4@25%", "peer-offload@25%", "memory-ar"
    family: str  # the --modes name it came from: "lever", "sd-chain", "peer-assisted", ...
    tree: str | None = None  # draft tree policy; None for autoregressive modes
    budget: str | None = None  # the DRAM budget label; None for memory-resident modes
    budget_bytes: int | None = None  # target weights allowed in DRAM
    throttle: str = "none"  # flash profile
    isolated: bool = False  # ran in its own child process
    memory_limit_bytes: int | None = None  # the cgroup limit it ran under, if any
    limit: str | None = None  # with --limits: the limit of the axis it ran at, e.g. "1GiB"
    limit_enforced: bool = False  # True only when a kernel memory limit was in force
    note: str | None = None  # what the mode found when it opened (the peer's placement)
    command: str | None = None  # the command line an external program ran (llama.cpp's)
    # engine modes, once open: the decode plan they ran (plan/decode.py: trees, lookup or
    # ar), whether the cost model chose it (plan auto), and the tok/s it predicted for each
    # plan it weighed; budget_bytes above is then the budget the engine planned
    plan: str | None = None
    plan_auto: bool = False
    predicted_tok_s: dict[str, float] = {}
    # an engine mode in a child of its own, once open and before its first request: the
    # child's RssAnon (what a limit cannot reclaim: heap, weights read) and RssFile (pages of
    # its libraries and mapped files, which a limit can drop and page in again)
    idle_anon_rss_bytes: int | None = None
    idle_file_rss_bytes: int | None = None


class PromptRun(msgspec.Struct, frozen=True, omit_defaults=True):
    """One mode decoding one prompt."""

    mode: str
    prompt_set: str
    prompt_index: int
    prompt_tokens: int
    new_tokens: int
    first_token_s: float  # prefill + the first token
    decode_s: float  # from the end of the first step to the last token
    agreement: float | None  # share of tokens equal to the reference mode's, position by position
    tokens: list[int]
    bytes_read: int = 0  # from storage during this prompt (prefill included)
    steps: int = 0  # target passes; 0 where a mode cannot count them
    first_step_tokens: int = 1  # tokens the first step (with the prefill) produced
    peak_rss_bytes: int | None = None  # of the process that ran the mode, so far
    cgroup_peak_bytes: int | None = None  # of its cgroup (page cache included), so far
    failed: str | None = None  # the error, when this prompt did not decode
    # what an external program reported of itself: llama.cpp's own timings, its command
    # line and generated text (bench/llamacpp.py)
    reported: dict[str, float | int | str] | None = None

    @property
    def decode_tokens(self) -> int:
        """Tokens of the decode phase: those after the first step, which the prefill made."""
        return max(self.new_tokens - self.first_step_tokens, 0)

    @property
    def decode_tok_s(self) -> float | None:
        return decode_rate(self.decode_tokens, self.decode_s)


class ModeSummary(msgspec.Struct, frozen=True, omit_defaults=True):
    mode: str
    prompt_set: str
    prompts: int  # prompts decoded without failure
    decode_tok_s: float | None = None  # total decoded tokens / total decode seconds
    mean_first_token_s: float | None = None
    agreement: float | None = None
    mean_accepted: float | None = None  # new tokens per target pass
    bytes_per_token: float | None = None  # storage bytes read per generated token
    effective_bandwidth: float | None = None  # bytes read / seconds of the requests, bytes/s
    peak_rss_bytes: int | None = None
    cgroup_peak_bytes: int | None = None
    failed: str | None = None  # the first error of this mode on this prompt set


class Ratios(msgspec.Struct, frozen=True, omit_defaults=True):
    """Lever's decode tok/s over a baseline's; a baseline that is absent or failed is left out."""

    lever_vs_flash_ar: float | None = None
    lever_vs_best_sd: float | None = None
    lever_vs_memory_ar: float | None = None
    lever_vs_peer: float | None = None
    lever_vs_llamacpp: float | None = None


class LimitFigures(msgspec.Struct, frozen=True, omit_defaults=True):
    """Decode tok/s under one memory limit (all prompt sets pooled; the fastest mode of a
    kind), and each mode's peaks there, in GiB: its process's resident memory (mapped
    files it read included), and its cgroup's (what the limit counted)."""

    lever: float | None = None
    plain: float | None = None  # the plain path, no torch: the faster of ar and lookup
    flash_ar: float | None = None
    best_sd: float | None = None
    llamacpp_best: float | None = None
    plan: str | None = None  # the decode plan Lever ran there
    peak_gib: float | None = None  # Lever's peak there: its process's RSS or its cgroup's, higher
    peak_rss_gib: dict[str, float] = {}
    cgroup_peak_gib: dict[str, float] = {}


class Summary(msgspec.Struct, frozen=True, omit_defaults=True):
    """The headline ratios at one budget (or, with --limits, the first limit): averaged
    (arithmetic mean) over the prompt sets where both modes ran, and per prompt set.
    `compared` names the modes behind each ratio. With --limits also the figures of each
    limit, the memory-resident rates, the sizes of the target's layout and of its GGUF,
    and the lowest token agreement of our modes with the reference; Lever under 3 GiB over
    memory-resident AR; and the idle Lever engine's resident memory in MiB, anonymous and
    file-backed, from its child at the largest limit where it was measured."""

    budget: str | None = None
    limit: str | None = None
    layout_bytes: int | None = None
    gguf_bytes: int | None = None
    min_agreement: float | None = None
    # by class of text (bench/class_summary.py): class -> limit -> Lever over llama.cpp's
    # best; the worst prompt's ratio; the largest (best forced plan / auto) on a prompt
    classes: dict[str, dict[str, float]] = {}
    min_prompt_ratio: float | None = None
    max_plan_regret: float | None = None
    limits: dict[str, LimitFigures] = {}
    memory_ar_quantized: float | None = None
    memory_ar_bf16: float | None = None
    lever_over_memory_ar_3gib: float | None = msgspec.field(
        default=None, name="lever_over_memory_ar_3GiB"
    )
    idle_rss_mib: dict[str, float] = {}  # {"anon": MiB, "file": MiB}
    lever_vs_flash_ar: float | None = None
    lever_vs_best_sd: float | None = None
    lever_vs_memory_ar: float | None = None
    lever_vs_peer: float | None = None
    lever_vs_llamacpp: float | None = None
    per_prompt_set: dict[str, Ratios] = {}
    compared: dict[str, dict[str, str]] = {}  # prompt set -> {"lever": mode, "best_sd": ...}


class BenchResults(msgspec.Struct, frozen=True, tag="bench", tag_field="kind"):
    machine: Machine
    command: str  # the command line that produced this file
    config: dict[str, object]
    reference_mode: str
    modes: list[ModeInfo]
    runs: list[PromptRun]
    summaries: list[ModeSummary]
    summary: Summary
    disk: list[DiskProfile] = []  # raw bandwidth measured in the same run
    schema: int = SCHEMA_VERSION

    def info(self, mode: str) -> ModeInfo:
        return next(m for m in self.modes if m.name == mode)

    @property
    def prompt_sets(self) -> list[str]:
        return list(dict.fromkeys(s.prompt_set for s in self.summaries))


class SweepPoint(msgspec.Struct, frozen=True):
    """One (flash profile, DRAM budget) point of a sweep: a bench run of its modes."""

    throttle: str
    budget: str
    budget_bytes: int
    target_bytes: int  # the target's weights, what a percentage budget is a share of
    results: BenchResults


class SweepResults(msgspec.Struct, frozen=True, tag="sweep", tag_field="kind"):
    machine: Machine
    command: str
    config: dict[str, object]
    points: list[SweepPoint]
    disk: list[DiskProfile] = []
    schema: int = SCHEMA_VERSION


class RequestRun(msgspec.Struct, frozen=True, omit_defaults=True):
    """One request of a concurrent round (bench/concurrency.py); times in seconds."""

    prompt_set: str
    prompt_index: int
    prompt_tokens: int
    new_tokens: int
    started_s: float  # when it was sent, from the start of its round
    first_token_s: float  # from its start to its first token
    ended_s: float  # when its response ended, from the start of its round
    # the tokens after those that came with the first / the seconds from them to the last
    decode_tok_s: float | None
    tokens: list[int]
    # share of tokens equal to its own sequential run's (ours with one request at a time)
    agreement: float | None = None
    reported: dict[str, float | int | str] | None = None  # llama-server's own timings


class Round(msgspec.Struct, frozen=True):
    """Requests sent together; wall_s runs from the first one's start to the last one's end."""

    requests: list[RequestRun]
    wall_s: float


class Joining(msgspec.Struct, frozen=True):
    """A prompt joining requests already decoding (bench/joining.py); times in seconds."""

    prompt_set: str
    prompt_index: int
    prompt_tokens: int
    first_token_alone_s: float  # the same engine, nobody else decoding
    first_token_busy_s: float  # with the others decoding beside it
    running: int  # the requests decoding when it came
    step_s: float  # their median time between steps before it came
    gap_s: float | None  # the longest of theirs while it came in (to its first token)


class ConcurrencyRun(msgspec.Struct, frozen=True, omit_defaults=True):
    """One server (ours, or llama-server with or without its draft) under one memory limit,
    taking `parallel` requests at once, over rounds of that many."""

    engine: str  # "lever", "llama-server" or "llama-server-draft"
    limit: str  # e.g. "1GiB"
    parallel: int
    rounds: list[Round] = []
    aggregate_tok_s: float | None = None  # concurrency_summary.aggregate_tok_s
    mean_first_token_s: float | None = None
    mean_request_decode_tok_s: float | None = None
    peak_rss_bytes: int | None = None  # of the process that served
    cgroup_peak_bytes: int | None = None  # of its cgroup (page cache included)
    memory_limit_bytes: int | None = None
    limit_enforced: bool = False
    plan: str | None = None  # ours: the decode plan the engine chose
    budget_bytes: int | None = None  # ours: the DRAM budget its memory plan gave the target
    command: str | None = None  # llama-server's command line
    joining: Joining | None = None  # ours with several at once: a prompt joining them
    failed: str | None = None


class ConcurrencySummary(msgspec.Struct, frozen=True):
    """The issue's figures (None where a run they need is absent or failed): Lever's
    aggregate with 4 requests over its aggregate with 1 under 1 GiB; Lever's aggregate with
    4 over the better llama-server's (with or without its draft) with 4 slots, under 1 and
    3 GiB, and with 1 and 8 under 3 GiB; a prompt joining our requests already decoding;
    the lowest agreement of our concurrent requests with their sequential runs; and every
    aggregate tok/s, limit -> engine -> requests at once."""

    aggregate_4_over_1_at_1gib: float | None = msgspec.field(
        default=None, name="aggregate_4_over_1_at_1GiB"
    )
    aggregate_4_vs_llamacpp_server_1gib: float | None = msgspec.field(
        default=None, name="aggregate_4_vs_llamacpp_server_1GiB"
    )
    aggregate_4_vs_llamacpp_server_3gib: float | None = msgspec.field(
        default=None, name="aggregate_4_vs_llamacpp_server_3GiB"
    )
    aggregate_1_vs_llamacpp_server_3gib: float | None = msgspec.field(
        default=None, name="aggregate_1_vs_llamacpp_server_3GiB"
    )
    aggregate_8_vs_llamacpp_server_3gib: float | None = msgspec.field(
        default=None, name="aggregate_8_vs_llamacpp_server_3GiB"
    )
    # a prompt joining requests already decoding (the worst run): its first token's time
    # over its time alone, and their longest gap meanwhile over their step before it came
    ttft_joining_busy_over_alone: float | None = None
    joining_gap_over_step: float | None = None
    min_agreement: float | None = None
    aggregates: dict[str, dict[str, dict[str, float | None]]] = {}


class ConcurrencyResults(msgspec.Struct, frozen=True, tag="concurrency", tag_field="kind"):
    machine: Machine
    command: str
    config: dict[str, object]
    runs: list[ConcurrencyRun]
    summary: ConcurrencySummary
    disk: list[DiskProfile] = []
    schema: int = SCHEMA_VERSION


AnyResults = BenchResults | SweepResults | ConcurrencyResults


def write_results(results: AnyResults, path: Path) -> None:
    _check_finite(msgspec.to_builtins(results), "results")  # JSON would turn NaN into null
    raw = msgspec.json.encode(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_bytes(msgspec.json.format(raw, indent=2) + b"\n")
    os.replace(tmp, path)


def read_results(path: Path) -> AnyResults:
    """Read and validate a results file; a corrupted or foreign file raises ResultsError."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ResultsError(f"{path}: cannot read results ({e.strerror})") from None
    try:
        schema = msgspec.json.decode(raw, type=_SchemaOnly).schema
    except msgspec.DecodeError as e:
        raise ResultsError(f"{path}: not a results file ({e})") from None
    if schema != SCHEMA_VERSION:
        raise ResultsError(
            f"{path}: results schema {schema}, this lever_actors reads schema {SCHEMA_VERSION}; "
            "run the benchmark again"
        )
    try:
        return msgspec.json.decode(raw, type=AnyResults)
    except msgspec.DecodeError as e:
        raise ResultsError(f"{path}: invalid results file ({e})") from None


class _SchemaOnly(msgspec.Struct):
    schema: int = 1  # files from before the schema field are schema 1


def _check_finite(value: object, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}: results hold finite figures or none")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, f"{where}[{i}]")


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
