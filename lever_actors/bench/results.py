"""The benchmark's results file: msgspec Structs, validated when read back."""

from __future__ import annotations

import platform
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import torch

from lever_actors.device.disk_profile import DiskProfile


class Machine(msgspec.Struct, frozen=True):
    cpu: str
    cores: int
    torch_version: str
    python_version: str
    date: str

    @classmethod
    def here(cls) -> Machine:
        import os

        return cls(
            cpu=_cpu_name(),
            cores=os.cpu_count() or 0,
            torch_version=str(torch.__version__),
            python_version=platform.python_version(),
            date=datetime.now(UTC).strftime("%Y-%m-%d"),
        )


class PromptRun(msgspec.Struct, frozen=True):
    """One mode decoding one prompt."""

    mode: str
    prompt_set: str
    prompt_index: int
    prompt_tokens: int
    new_tokens: int
    first_token_s: float  # prefill + the first token
    decode_s: float  # the remaining new_tokens - 1 tokens
    agreement: float  # share of tokens equal to the reference mode's, position by position
    tokens: list[int]
    bytes_read: int = 0  # from flash during this prompt (prefill included)
    steps: int = 0  # target passes; 0 for modes without a pipeline

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else float("nan")


class ModeSummary(msgspec.Struct, frozen=True):
    mode: str
    prompt_set: str
    decode_tok_s: float  # total decoded tokens / total decode seconds
    mean_first_token_s: float
    agreement: float
    mean_accepted: float  # new tokens per target pass (nan where there are no passes)
    bytes_per_token: float  # flash bytes read per generated token
    effective_bandwidth: float  # flash bytes read / seconds of the request, bytes/s


class BenchResults(msgspec.Struct, frozen=True):
    machine: Machine
    config: dict[str, object]
    reference_mode: str
    runs: list[PromptRun]
    summaries: list[ModeSummary]
    ratios: dict[str, float]  # "a_vs_b" -> decode tok/s of a / that of b, over all prompt sets
    disk: list[DiskProfile] = []  # raw bandwidth measured in the same run


def write_results(results: BenchResults, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(results), indent=2) + b"\n")


def read_results(path: Path) -> BenchResults:
    return msgspec.json.decode(path.read_bytes(), type=BenchResults)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
