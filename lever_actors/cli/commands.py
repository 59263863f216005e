"""The `lever-actors` commands, in `--help`'s order: each one's module under lever_actors.cli,
which registers it (`add_commands`), and its line in `--help`. Only the module of the
command run is imported, so `lever-actors --help` loads no torch."""

from __future__ import annotations

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": (
        "generate",
        "stream text: the pipeline (default: the real pair) or a model in DRAM",
    ),
    "serve": (
        "serve",
        "an OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models",
    ),
    "fetch-models": ("tools", "download, assemble and verify the real model pair"),
    "convert": ("tools", "write the flash layout of an HF directory or GGUF file"),
    "profile-disk": ("tools", "raw O_DIRECT sequential read bandwidth"),
    "train-exit": ("tools", "train the early-exit predictor of a flash layout, saved beside it"),
    "export-hf": ("tools", "write an HF safetensors directory of a GGUF file or flash layout"),
    "build-llamacpp": (
        "tools",
        "build llama.cpp once into the cache, for the bench's llamacpp-* modes",
    ),
    "bench": ("bench", "measure decoding modes on the real model pair"),
    "report": ("report", "markdown, plots and the README's Results section from a results JSON"),
    "check-exact": (
        "check_exact",
        "every speculative policy against one-token greedy of the same layout, on real "
        "prompts; exits 1 on any divergence",
    ),
}


def help_of(command: str) -> str:
    return COMMANDS[command][1]


def modules() -> dict[str, list[str]]:
    """Each command module, in order, with the commands it registers."""
    found: dict[str, list[str]] = {}
    for command, (module, _) in COMMANDS.items():
        found.setdefault(module, []).append(command)
    return found


def command_in(argv: list[str]) -> str | None:
    """The command `argv` names: its first word that is one (the value of --cache-dir is a
    path, never a command)."""
    after_cache_dir = False
    for arg in argv:
        if arg in COMMANDS and not after_cache_dir:
            return arg
        after_cache_dir = arg == "--cache-dir"
    return None
