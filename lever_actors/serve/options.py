"""How `serve` listens and what it lets a request do: one struct, checked when it is built
(by the CLI's flags or a caller), before any engine opens."""

from __future__ import annotations

import ipaddress

import msgspec

from lever_actors.config import DEFAULT_MAX_NEW_TOKENS, check_max_new_tokens
from lever_actors.errors import ConfigError

DRAIN_SECONDS = 10.0  # what requests still running at SIGTERM get before they are cut
# bodies larger are refused before they are read whole: a prompt of the real target's
# whole context is about 130 KB of text, and an 8 MB one blocked the server for 9.9 s
DEFAULT_MAX_BODY = 4 << 20
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class ServeOptions(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free one
    model_name: str = "lever"  # the id /v1/models lists
    queue: int = 8  # requests that may wait beside those running (--parallel); more get 429
    api_key: str | None = None  # required as "Authorization: Bearer KEY" when given
    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS  # for a request that gives none
    # the names a request's Host header may give, others get 421; None: the loopback names
    # where `host` is loopback, else any
    allowed_hosts: tuple[str, ...] | None = None
    grace: float = DRAIN_SECONDS  # seconds running requests get after SIGTERM
    max_body: int = DEFAULT_MAX_BODY  # bytes; a larger body gets 413 before it is read whole
    # each request's deadline_seconds (options.py); None: none
    deadline_seconds: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port}: expected 0 to 65535")
        if self.queue < 0:  # each request would get 429
            raise ConfigError(f"queue = {self.queue}: expected >= 0")
        check_max_new_tokens(self.default_max_tokens)
        if not self.grace >= 0:  # NaN too
            raise ConfigError(f"grace = {self.grace!r}: expected >= 0 seconds")
        if self.max_body < 1:
            raise ConfigError(f"max_body = {self.max_body}: expected >= 1 byte")
        if self.deadline_seconds is not None and not self.deadline_seconds > 0:
            raise ConfigError(f"deadline_seconds = {self.deadline_seconds!r}: expected > 0")
        names = self.allowed_hosts
        if names is None and is_loopback(self.host):
            names = (*LOOPBACK_NAMES, self.host)
        if names is not None:  # as a Host header's name reads: "[::1]" is ::1
            msgspec.structs.force_setattr(self, "allowed_hosts", tuple(map(_bare, names)))

    @property
    def keyless_exposure(self) -> bool:
        """Whether anyone who reaches the address may use it: no key, not loopback."""
        return self.api_key is None and not is_loopback(self.host)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface alone."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def _bare(name: str) -> str:
    """A host name as a Host header's name is compared: lower case, an IPv6 address without
    its brackets."""
    return name.strip().lower().removeprefix("[").removesuffix("]")
