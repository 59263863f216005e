"""A grammar's source compiled to llguidance's form and checked, under a time limit.

llguidance's compile time grows with some schemas without bound (a `patternProperties` of
300 patterns took 3 s, of 1,000 minutes, and it holds no fuel limit that stops it), and a
thread cannot be stopped, so the check runs in a child process that is killed at
CHECK_SECONDS; a source that passed compiles in about as long again where it is used.
Checks are remembered by source, so a schema sent again (an agent's tools) costs nothing.
Torch-free: the child imports only this module and llguidance.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Literal

import llguidance

GrammarKind = Literal["json", "json_schema", "regex", "lark"]
# JSON's whitespace between tokens: a space, or a line break and an indent; unbounded, a
# model may fill its tokens with it (a schema's "x-guidance" may say otherwise)
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"
CHECK_SECONDS = 5.0  # real schemas compile in milliseconds to a second
CHECKS_KEPT = 256


def compiled(kind: GrammarKind, source: str) -> str:
    """The grammar in llguidance's own form (ValueError: a schema that is not an object)."""
    match kind:
        case "json":
            return _from_schema({"type": "object"})
        case "json_schema":
            return _from_schema(source)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        case "lark":
            return llguidance.LLMatcher.grammar_from_lark(source)


@functools.lru_cache(maxsize=CHECKS_KEPT)
def refusal(kind: GrammarKind, source: str) -> str:
    """Blocking: why llguidance refuses the grammar, on one line; "" where it compiles."""
    if kind == "json":
        return ""  # one fixed grammar
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__],
            input=json.dumps({"kind": kind, "source": source}).encode(),
            capture_output=True,
            timeout=CHECK_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"it did not compile within {CHECK_SECONDS:g} s (the limit); simplify it"
    if done.returncode != 0:
        raise RuntimeError(f"the grammar check failed: {done.stderr.decode(errors='replace')}")
    return done.stdout.decode()


def _check(kind: GrammarKind, source: str) -> str:
    """In this process: the refusal (one line), or "" where the grammar compiles."""
    try:
        error = llguidance.LLMatcher.validate_grammar(compiled(kind, source))
    except ValueError as cause:  # a schema that is not a JSON object
        error = str(cause)
    return _one_line(error)


def _one_line(error: str) -> str:
    """llguidance's message on one line: its lines joined, the caret lines under the source
    left out (an error is one line, in a log and in an HTTP body alike)."""
    lines = (line.strip() for line in error.splitlines())
    return " ".join(line for line in lines if line.strip("^ "))


def _from_schema(schema: str | dict[str, object]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_pattern": JSON_WHITESPACE}
    )


if __name__ == "__main__":  # the child of `refusal`: the source on stdin, the refusal out
    asked = json.load(sys.stdin)
    sys.stdout.write(_check(asked["kind"], asked["source"]))
