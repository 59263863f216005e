"""The library's loggers: one-line events with key=value fields over the standard library's
`logging`, so that the application decides where messages go. Unconfigured, warnings reach
stderr (through logging's last resort) and nothing else shows; the CLI sends its level to
stderr. (structlog did this before, at 0.1 s of every command's start for its imports.)"""

from __future__ import annotations

import logging
import sys

PACKAGE = "lever_actors"


class Logger:
    """log.info("what happened", key=value) -> the record 'what happened key=value'."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def debug(self, event: str, **fields: object) -> None:
        self._log(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: object) -> None:
        self._log(logging.INFO, event, fields)

    def warning(self, event: str, **fields: object) -> None:
        self._log(logging.WARNING, event, fields)

    def exception(self, event: str, **fields: object) -> None:
        """An ERROR with the exception being handled."""
        self._log(logging.ERROR, event, fields, exc_info=True)

    def _log(
        self, level: int, event: str, fields: dict[str, object], exc_info: bool = False
    ) -> None:
        if self.logger.isEnabledFor(level):
            line = " ".join([event, *(f"{key}={value}" for key, value in fields.items())])
            # the caller's line; exc_info None where none is asked for, as logging's own calls
            self.logger.log(level, line, exc_info=exc_info or None, stacklevel=3)


def get_logger(name: str) -> Logger:
    """A logger under the package's: log.info("what happened", key=value)."""
    return Logger(logging.getLogger(name))


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
