"""The text a request emits, token by token, as its stop strings allow: held back while it
may be the start of one, and cut where the first one begins, as OpenAI's servers leave it
out. With `keep`, the old behaviour: every token's text at once, the stop string in it."""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    def __init__(self, stops: Sequence[str], keep: bool = False) -> None:
        self.stops = tuple(stops)
        self.keep = keep
        self.longest = max(map(len, self.stops), default=0)
        self.text = ""  # decoded so far
        self.sent = 0  # how much of it was emitted

    def push(self, delta: str) -> tuple[str, bool]:
        """Take a token's text; -> what to emit now, and whether a stop string ended it."""
        # an occurrence starts within the held-back tail or in the new text
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if self.keep:
            self.sent = len(self.text)
            return delta, bool(hits)
        if hits:
            return self._emit(min(hits)), True
        return self._emit(len(self.text) - self._held()), False

    def flush(self) -> str:
        """What was held back, at an end no stop string made."""
        return self._emit(len(self.text))

    def _held(self) -> int:
        """The longest tail not yet emitted that some stop string starts with."""
        for n in range(min(self.longest - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _emit(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out
