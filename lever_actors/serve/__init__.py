"""`lever-actors serve`: an OpenAI-compatible HTTP server over one Engine.

The routes are a Starlette application (app.py) over the request and response bodies of
schemas.py, its errors errors.py's; admission.py decides who comes in, waits or gets 429,
and drains. hypercorn's trio worker serves it in the engine's own trio run, so a request
handler awaits the engine directly.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from contextlib import contextmanager
from functools import partial

import hypercorn.config
import hypercorn.trio
import trio

from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.errors import INTERRUPTED, ConfigError
from lever_actors.logs import get_logger
from lever_actors.progress import Progress
from lever_actors.serve.admission import Admission
from lever_actors.serve.app import build_app
from lever_actors.serve.options import ServeOptions

log = get_logger(__name__)

DEFAULTS = ServeOptions()

# past the grace, what the connections get to close before the exit: more than hypercorn's
# graceful_timeout (3 s), after which it cancels what it can
CLOSE_SECONDS = 5.0

# trio logs each accept that finds no file descriptor left (EMFILE) with a traceback
ACCEPT_LOGGER = logging.getLogger("trio.serve_listeners")


async def serve(
    config: EngineConfig,
    options: ServeOptions = DEFAULTS,
    *,
    drain_on: Collection[signal.Signals] = (signal.SIGTERM,),
    progress: Progress | None = None,
    opened: Callable[[Engine], object] = lambda engine: None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open the engine and serve it as `options` say until cancelled, or until one of
    `drain_on` arrives (the main thread's trio run alone can take signals; give none
    elsewhere): then new requests get 503, those inside `options.grace` seconds to finish
    before they are cut, and serve returns. `task_status.started` gets the bound addresses
    ("http://127.0.0.1:8000"; port 0 binds a free one); `opened` hears of the engine once it
    has loaded, before the port opens."""
    check_address(options.host, options.port)  # before the engine loads, which can take minutes
    if options.keyless_exposure:
        log.warning(f"serving {options.host} without an API key: whoever reaches it can use it")
    async with Engine.open(config, progress=progress) as engine:
        opened(engine)
        app = build_app(engine, options)
        settings = hypercorn.config.Config()
        settings.bind = [f"{options.host}:{options.port}"]
        settings.accesslog = None
        with (
            _receiver(drain_on) as received,
            _one_line(ACCEPT_LOGGER),
            ShutdownDeadline() as deadline,
        ):
            # the receiver opens before the port does: no signal is missed
            drained = partial(
                _drain_on_signal, received, app.state.admission, options.grace, deadline
            )
            async with trio.open_nursery() as nursery:
                if drain_on:  # the main thread's run: it may take signals
                    nursery.start_soon(_interrupted, deadline)
                # hypercorn types an ASGI app narrower than Starlette's (pgjones/hypercorn#353)
                await hypercorn.trio.serve(
                    app,  # type: ignore[arg-type]
                    settings,
                    shutdown_trigger=drained,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()


def check_address(host: str, port: int) -> None:
    """Refuse an address serve could not listen on, in one line: a malformed host
    (ConfigError); a host that does not resolve or is not this machine's, or a port taken
    (OSError naming the address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as hypercorn chooses
    where = f"{host}:{port}"
    try:
        address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn binds
            probe.bind(address)
    except UnicodeError:  # the IDNA codec's, for a name no DNS could hold ("a..b")
        raise ConfigError(f"host {host!r}: not a host name") from None
    except OSError as error:
        raise OSError(error.errno, error.strerror, where) from None


class _WithoutTraceback(logging.Filter):
    """A record as one line: a client-side condition the server rides out (it retries)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


@contextmanager
def _one_line(logger: logging.Logger) -> Iterator[None]:
    """`logger`'s records without their tracebacks while the block runs."""
    without = _WithoutTraceback()
    logger.addFilter(without)
    try:
        yield
    finally:
        logger.removeFilter(without)


@contextmanager
def _receiver(signals: Collection[signal.Signals]) -> Iterator[AsyncIterator[int] | None]:
    """The signals' receiver while the block runs; None where there are none to take."""
    if not signals:
        yield None
        return
    with trio.open_signal_receiver(*signals) as received:
        yield received


async def _interrupted(deadline: ShutdownDeadline) -> None:
    """Ctrl-C as a KeyboardInterrupt of our own: trio raises it wherever the run is, and
    inside hypercorn's tasks hypercorn takes it for a shutdown (the command then exited 0)."""
    with trio.open_signal_receiver(signal.SIGINT) as received:
        await anext(received)
    deadline.arm(CLOSE_SECONDS, INTERRUPTED)
    raise KeyboardInterrupt


async def _drain_on_signal(
    received: AsyncIterator[int] | None,
    admission: Admission,
    grace: float,
    deadline: ShutdownDeadline,
) -> None:
    """Return, for hypercorn to close, once a signal has come and the requests have left."""
    if received is None:
        await trio.sleep_forever()
    number = await anext(received)
    log.warning(f"{signal.Signals(number).name}: shutting down", grace_seconds=grace)
    deadline.arm(grace + CLOSE_SECONDS, 0)
    await admission.drain(grace)


class ShutdownDeadline:
    """Once armed, ends the process that many seconds later unless the server has returned:
    hypercorn shields its writes from cancellation, so a client that reads nothing would
    otherwise hold a shutdown for ever (#64 E6). Disarmed when the block ends."""

    def __init__(self, exit: Callable[[int], object] = os._exit) -> None:
        self._exit = exit
        self._timer: threading.Timer | None = None

    def __enter__(self) -> ShutdownDeadline:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def arm(self, seconds: float, code: int) -> None:
        """Exit with `code` after `seconds`; the first arming holds."""
        if self._timer is None:
            self._timer = threading.Timer(seconds, self._expire, (seconds, code))
            self._timer.daemon = True
            self._timer.start()

    def _expire(self, seconds: float, code: int) -> None:
        log.warning(f"a client still held its connection {seconds:g} s into the shutdown; exiting")
        sys.stderr.flush()
        self._exit(code)
