"""The library's loggers: structlog's call style over the standard library's `logging`, so
that the application decides where messages go. Unconfigured, warnings reach stderr (through
logging's last resort) and nothing else shows; the CLI sends its level to stderr."""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import EventDict

PACKAGE = "lever_actors"


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A logger under the package's: log.info("what happened", key=value)."""
    return structlog.wrap_logger(
        logging.getLogger(name), processors=[_line], wrapper_class=structlog.stdlib.BoundLogger
    )


def _line(_logger, _method: str, event: EventDict) -> str:
    """'what happened key=value ...' as the message the logging record carries."""
    what = event.pop("event")
    return " ".join([what, *(f"{key}={value}" for key, value in event.items())])


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (tests and tools swap it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # noqa: D102 - StreamHandler's attribute, looked up per record
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


_cli_handler = _CurrentStderr()
_cli_handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))


def log_to_stderr(verbose: bool) -> None:
    """The CLI's setting: the package's messages at INFO (verbose) or WARNING to stderr."""
    logger = logging.getLogger(PACKAGE)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    if _cli_handler not in logger.handlers:
        logger.addHandler(_cli_handler)
