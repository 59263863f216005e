"""Exception types the library raises for bad input; each message names the file and the cause."""

INTERRUPTED = 130  # the exit status of a command Ctrl-C ended: the CLI's and serve's deadline


class LeverError(Exception):
    """Base of every error lever_actors raises on purpose."""


class CheckpointError(LeverError, ValueError):
    """A checkpoint (HF directory, GGUF file) is missing, malformed or unsupported."""


class CorruptLayoutError(CheckpointError):
    """Bytes read from a flash layout do not match their checksum."""


class FetchError(LeverError):
    """Fetching or verifying the real model files failed."""


class ConfigError(LeverError, ValueError):
    """A configuration value is invalid."""


class ContextLengthError(ConfigError):
    """A request's prompt and new tokens do not fit the context."""

    def __init__(self, message: str, prompt_tokens: int, context_tokens: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens


class ConsumerStalledError(LeverError, RuntimeError):
    """A request's consumer took no token for `EngineConfig.stall_seconds` while its buffer
    was full: the engine ended the request, so that the others (which wait for its next
    tree before each pass) could run."""


class DeadlineError(LeverError, TimeoutError):
    """A request's `deadline_seconds` passed before its first token, while it waited for the
    engine or was being prefilled: it was cancelled."""


class EngineClosedError(LeverError, RuntimeError):
    """A request came after its engine's `open` block had ended."""
