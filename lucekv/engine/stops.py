"""Stop strings: cut the output at the first stop string and never leak any part of it."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""  # text that might be the start of a stop string

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, stopped)."""
        buf = self.held + text
        if not self.stops:
            return buf, False
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
