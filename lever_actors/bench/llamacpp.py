"""llama.cpp as a peer: what a user runs today, on the same GGUF files and prompts.

llamacpp-ar runs `llama-completion`; llamacpp-spec runs `llama-speculative-simple` with the
draft GGUF (`--spec-type draft-simple`, up to `draft_max` drafted tokens). Both decode
greedily (`--temp 0`) on `threads` threads, one process per prompt, built by
`lever-actors build-llamacpp` (bench/llamacpp_build.py).

The prompt's token ids are written out as text (special tokens included) to a file that
llama.cpp reads with `-f` (no shell quoting, `--no-escape` so a backslash stays a
backslash; `-f` drops one trailing newline, so one is added). llama.cpp tokenizes it again:
the prompt token count it reports is recorded beside ours. Its generated text is encoded
with the target's tokenizer for the bench's agreement, so a difference of tokenization
alone can lower agreement, which is reported, not required (llama.cpp also quantizes
activations).

Timings are llama.cpp's own, parsed from its log: `eval time` of llama-completion (tokens
after the first, which comes with the prompt) and `decoded N tokens in T seconds` of
llama-speculative-simple; the harness's decode rate then equals llama.cpp's. Prefill, load
time and the speculative counters go into the run's `reported` figures, with the exact
command line. Peak RSS is the process's own VmHWM, polled while it runs (getrusage of a
child forked from this process counts this process's memory too).

Isolated (`--isolate`), each llama.cpp process is put into a memory cgroup of its own
with the mode's limit before it executes, so the limit bounds llama.cpp alone, not the
Python process that starts it; its GGUFs are evicted from the page cache before each prompt
either way, so each run reads them from storage as a fresh start would.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import resource
import shlex
import signal
import struct
import subprocess
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import gguf
import msgspec
import trio

from lever_actors.bench.isolation import CgroupSupport, MemoryCgroup, evict_from_page_cache
from lever_actors.bench.llamacpp_output import (
    Timings,
    generated_text,
    parse_completion_timings,
    parse_speculative_timings,
    without_colors,
)
from lever_actors.bench.mode import Decoded, ModeFailed
from lever_actors.bench.results import ModeInfo
from lever_actors.checkpoints.gguf_tokenizer import tokenizer_from_gguf
from lever_actors.checkpoints.tokenizer import Tokenizer, layout_tokenizer
from lever_actors.device.manifest import MANIFEST_NAME, read_manifest
from lever_actors.model.sampling import Sampling
from lever_actors.sizes import format_bytes
from lever_actors.threads import one_stream_environ

DEFAULT_DRAFT_MAX = 8
DEFAULT_THREADS = 2
POLL_S = 0.02  # how often the process's peak RSS is read while it runs
RUN_TIMEOUT_S = 3600.0  # one prompt; past it the process is killed and the row fails


class LlamaCppSpec(msgspec.Struct, frozen=True, tag="llamacpp"):
    program: str  # llama-completion or llama-speculative-simple; "" when unavailable
    model: str  # the target's GGUF
    tokenizer: str  # prompts' ids <-> text: a flash layout, HF directory or GGUF
    prompt_dir: str  # where the prompt files go (named by their text's hash, kept)
    draft: str | None = None  # the draft's GGUF: the speculative mode
    draft_max: int = DEFAULT_DRAFT_MAX
    threads: int = DEFAULT_THREADS
    unavailable: str | None = None  # why this mode cannot run (not built, no GGUF, ...)


def context_size(prompt_tokens: int, max_new_tokens: int, draft_max: int) -> int:
    """The KV cache llama.cpp allocates: enough for the prompt, the new tokens and one
    draft past them, in steps of 256 (its default is the model's whole context, which
    would charge it memory our modes never allocate)."""
    need = prompt_tokens + max_new_tokens + draft_max + 16
    return max(512, -(-need // 256) * 256)


def command_line(
    spec: LlamaCppSpec, prompt_file: Path, max_new_tokens: int, ctx_size: int
) -> list[str]:
    argv = [spec.program, "-m", spec.model]
    if spec.draft is not None:
        argv += ["-md", spec.draft, "--spec-type", "draft-simple"]
        argv += ["--spec-draft-n-max", str(spec.draft_max)]
    argv += ["-f", str(prompt_file), "-n", str(max_new_tokens), "-c", str(ctx_size)]
    argv += ["-t", str(spec.threads), "--temp", "0", "--seed", "0", "--no-escape"]
    argv += ["--color", "off"]
    if spec.draft is None:
        argv += ["-no-cnv", "--no-display-prompt"]
    return argv


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a flash layout, an HF directory or a GGUF (metadata only)."""
    tokenizer = None
    if (path / MANIFEST_NAME).is_file():
        tokenizer = layout_tokenizer(path, read_manifest(path))
    elif path.is_dir() and (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    elif path.suffix == ".gguf":
        tokenizer = tokenizer_from_gguf(gguf.GGUFReader(str(path)), path)
    if tokenizer is None:
        raise ModeFailed(f"unavailable: {path} has no tokenizer to write the prompts as text")
    return tokenizer


_GGUF_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_eos_id(path: Path) -> int | None:
    """The end-of-sequence id a GGUF's metadata names (tokenizer.ggml.eos_token_id), read
    from its header alone (gguf.GGUFReader maps every tensor first: seconds for a 1 GB
    file); None where it names none or `path` is no GGUF."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _gguf_int(m, b"tokenizer.ggml.eos_token_id")
    except (OSError, ValueError, struct.error):  # empty, short or not a GGUF
        return None


def _gguf_int(m: mmap.mmap, wanted: bytes) -> int | None:
    """The integer value of metadata key `wanted`, walking the key-value pairs."""
    if m[:4] != b"GGUF":
        return None
    version, _, n_kv = struct.unpack_from("<IQQ", m, 4)
    if version < 2:
        return None
    at = 24

    def string(at: int) -> tuple[bytes, int]:
        (length,) = struct.unpack_from("<Q", m, at)
        return m[at + 8 : at + 8 + length], at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind == _GGUF_STRING:
            return string(at)[1]
        if kind == _GGUF_ARRAY:
            inner, count = struct.unpack_from("<IQ", m, at)
            at += 12
            if inner in _GGUF_SCALARS:
                return at + count * struct.calcsize("<" + _GGUF_SCALARS[inner])
            for _ in range(count):
                at = skip(inner, at)
            return at
        return at + struct.calcsize("<" + _GGUF_SCALARS[kind])

    for _ in range(n_kv):
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", m, at)
        at += 4
        if key == wanted and kind in _GGUF_SCALARS and kind not in (6, 7, 12):
            return int(struct.unpack_from("<" + _GGUF_SCALARS[kind], m, at)[0])
        at = skip(kind, at)
    return None


@dataclass
class _Ran:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_rss_bytes: int | None
    bytes_read: int


class LlamaCppMode:
    """One llama.cpp program run per prompt; `cgroups` (with an isolated info) puts each
    run under the mode's memory limit."""

    def __init__(
        self, info: ModeInfo, spec: LlamaCppSpec, cgroups: CgroupSupport | None = None
    ) -> None:
        self.info = info
        self.spec = spec
        self.cgroups = cgroups
        self.cgroup: MemoryCgroup | None = None
        self.eos_id: int | None = None

    @property
    def speculative(self) -> bool:
        return self.spec.draft is not None

    async def open(self, stack: AsyncExitStack) -> None:
        spec = self.spec
        if spec.unavailable:
            raise ModeFailed(f"unavailable: {spec.unavailable}")
        if not os.access(spec.program, os.X_OK):
            raise ModeFailed(f"unavailable: {spec.program} is not an executable program")
        for path in (spec.model, spec.draft):
            if path is not None and not Path(path).is_file():
                raise ModeFailed(f"unavailable: no GGUF file at {path}")
        self.tokenizer = await trio.to_thread.run_sync(load_tokenizer, Path(spec.tokenizer))
        self.eos_id = await trio.to_thread.run_sync(gguf_eos_id, Path(spec.model))
        Path(spec.prompt_dir).mkdir(parents=True, exist_ok=True)
        limit = self.info.memory_limit_bytes
        usable = self.cgroups is not None and self.cgroups.usable
        if self.info.isolated and limit is not None and usable:
            assert self.cgroups is not None
            name = f"lever-bench-{os.getpid()}-{id(self)}"
            self.cgroup = MemoryCgroup(self.cgroups, name, limit)
            stack.callback(self.cgroup.remove)
        self.info = msgspec.structs.replace(
            self.info,
            memory_limit_bytes=self.cgroup.limit_bytes if self.cgroup else limit,
            limit_enforced=self.cgroup is not None,
        )

    def prompt_text(self, prompt: list[int]) -> str:
        """The prompt as text, special tokens spelled out; a leading BOS is left to
        llama.cpp, which adds one where the model asks for it."""
        bos = self.tokenizer.bos_id
        if prompt and prompt[0] == bos and self.tokenizer.encode("")[:1] == [bos]:
            prompt = prompt[1:]
        return self.tokenizer.decode(prompt)

    def prompt_file(self, text: str) -> Path:
        """The file `-f` reads: named by the text's hash and kept, so that the recorded
        command line can be run again; one newline more than the text, for the one `-f`
        drops."""
        content = text.encode() + b"\n"
        path = Path(self.spec.prompt_dir) / f"prompt-{hashlib.sha256(content).hexdigest()[:16]}.txt"
        if not path.is_file() or path.read_bytes() != content:
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_bytes(content)
            os.replace(tmp, path)
        return path

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int], sampling: Sampling
    ) -> Decoded:
        if not sampling.greedy:
            raise ModeFailed("the llama.cpp peer decodes greedily only")
        text = self.prompt_text(prompt)
        ctx = context_size(len(prompt), max_new_tokens, self.spec.draft_max)
        argv = command_line(self.spec, self.prompt_file(text), max_new_tokens, ctx)
        if self.info.command is None:
            self.info = msgspec.structs.replace(self.info, command=shlex.join(argv))
        evict_from_page_cache([Path(p) for p in (self.spec.model, self.spec.draft) if p])
        t0 = time.perf_counter()
        ran = await trio.to_thread.run_sync(self._run, argv)
        if ran.returncode != 0:
            raise ModeFailed(self._failure(ran))
        parse = parse_speculative_timings if self.speculative else parse_completion_timings
        timings = parse(ran.stderr)
        out, ended = generated_text(ran.stdout, text, self.speculative)
        if self.speculative and timings.generated is not None:
            ended = timings.generated <= max_new_tokens  # it stops past -n only at an end token
        tokens = self.tokenizer.backend.encode(out, add_special_tokens=False).ids
        end = self._end_id(stop_ids)
        if ended and end is not None:
            tokens.append(end)
        tokens = tokens[:max_new_tokens]
        decoded = self._stamped(tokens, timings, t0, ran.wall_s)
        decoded.bytes_read = ran.bytes_read
        decoded.peak_rss_bytes = ran.peak_rss_bytes
        if self.cgroup is not None:
            decoded.cgroup_peak_bytes = self.cgroup.peak_bytes()
        decoded.reported = _reported(timings, argv, out, ran.wall_s, len(prompt))
        return decoded

    def _end_id(self, stop_ids: frozenset[int]) -> int | None:
        """The id that stands for the end token llama.cpp does not print: the GGUF's EOS
        where the bench stops on it, else the one stop id."""
        if self.eos_id is not None and (not stop_ids or self.eos_id in stop_ids):
            return self.eos_id
        return next(iter(stop_ids)) if len(stop_ids) == 1 else None

    def _stamped(self, tokens: list[int], timings: Timings, t0: float, wall_s: float) -> Decoded:
        """Stamps on llama.cpp's own clock: evenly spaced at its decode rate, the first one
        where its decoding began (the process's wall time less its decode time)."""
        per_token = timings.decode_s / max(timings.decode_tokens, 1)
        if self.speculative:  # its decode time includes the first token's step
            first = t0 + max(wall_s - timings.decode_s, 0.0) + per_token
        else:
            first = t0 + max(wall_s - timings.decode_s, 0.0)
        stamps = [first + i * per_token for i in range(len(tokens))]
        steps = timings.steps if self.speculative else len(tokens)
        return Decoded(list(tokens), stamps, steps=steps or 0, first_step_tokens=1)

    def _failure(self, ran: _Ran) -> str:
        return failure(self.spec.program, ran.returncode, ran.stderr, self.cgroup)

    def _run(self, argv: list[str]) -> _Ran:
        """Run one llama.cpp process to its end, inside the cgroup when there is one; poll
        its peak RSS meanwhile."""
        command = in_cgroup(argv, self.cgroup)
        started = time.perf_counter()
        with (
            open(os.devnull, "rb") as stdin,
            _Capture() as stdout,
            _Capture() as stderr,
        ):
            process = subprocess.Popen(
                command,
                stdin=stdin,
                stdout=stdout.file,
                stderr=stderr.file,
                env=one_stream_environ(os.environ),  # its OpenMP as its own default has it
            )
            status, usage, peak = _wait_polling_peak(process)
            wall = time.perf_counter() - started
            return _Ran(
                returncode=status,
                stdout=stdout.read(),
                stderr=stderr.read(),
                wall_s=wall,
                peak_rss_bytes=peak,
                bytes_read=usage.ru_inblock * 512 if usage is not None else 0,
            )


def failure(program: str, returncode: int, stderr: str, cgroup: MemoryCgroup | None) -> str:
    """Why a llama.cpp process failed: its cgroup's OOM kill, else its last error line."""
    if cgroup is not None and cgroup.oom_kills():
        return (
            f"killed by the memory limit of {format_bytes(cgroup.limit_bytes)} "
            f"(cgroup OOM kill, exit status {returncode})"
        )
    lines = [line for line in without_colors(stderr).splitlines() if line.strip()]
    errors = [line for line in lines if " E " in line or "error" in line.lower()]
    last = (errors or lines or ["(no output)"])[-1].strip()
    if returncode < 0:
        why = f"killed by {signal.Signals(-returncode).name}"
    else:
        why = f"exit status {returncode}"
    return f"{Path(program).name} failed ({why}): {last}"


def in_cgroup(argv: list[str], cgroup: MemoryCgroup | None) -> list[str]:
    """`argv` run so that it moves itself into `cgroup` before it executes the program, which
    is then charged for everything it loads (the command as it is without a cgroup)."""
    if cgroup is None:
        return argv
    procs = str(cgroup.path / "cgroup.procs")
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]


def process_peak_rss(pid: int) -> int | None:
    """A running process's peak RSS (its VmHWM) in bytes; None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # exiting: its memory is gone
    return None


class _Capture:
    """An unnamed temporary file for a process's output (a pipe could fill and block it)."""

    def __enter__(self) -> _Capture:
        self.file = tempfile.TemporaryFile()
        return self

    def read(self) -> str:
        self.file.seek(0)
        return self.file.read().decode("utf-8", errors="replace")

    def __exit__(self, *exc) -> None:
        self.file.close()


def _wait_polling_peak(
    process: subprocess.Popen,
) -> tuple[int, resource.struct_rusage, int | None]:
    """Wait for `process`, reading its VmHWM until it exits: (exit code, its rusage, peak
    RSS bytes). Killed past RUN_TIMEOUT_S."""
    peak = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid == process.pid:
            break
        now = process_peak_rss(process.pid)
        if now is not None:
            peak = max(peak or 0, now)
        if time.monotonic() > deadline:
            process.kill()
        time.sleep(POLL_S)
    process.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
    return process.returncode, usage, peak


def _reported(
    timings: Timings, argv: list[str], text: str, wall_s: float, prompt_tokens: int
) -> dict[str, float | int | str]:
    """What the run's results keep of llama.cpp's own report."""
    figures: dict[str, float | int | str | None] = {
        "command": shlex.join(argv),
        "text": text,
        "wall_s": round(wall_s, 4),
        "decode_tokens": timings.decode_tokens,
        "decode_s": timings.decode_s,
        "decode_tok_s": timings.decode_tok_s,
        "prompt_tokens": timings.prompt_tokens,
        "our_prompt_tokens": prompt_tokens,
        "prefill_s": timings.prefill_s,
        "prefill_tok_s": (
            timings.prompt_tokens / timings.prefill_s
            if timings.prompt_tokens and timings.prefill_s
            else None
        ),
        "load_s": timings.load_s,
        "generated": timings.generated,
        "drafted": timings.drafted,
        "accepted": timings.accepted,
    }
    return {  # JSON holds finite figures only
        k: v
        for k, v in figures.items()
        if v is not None and not (isinstance(v, float) and not math.isfinite(v))
    }
