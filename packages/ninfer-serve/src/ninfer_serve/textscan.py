"""Helpers for scanning streamed text for markers that may be split across chunks."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`.

    A streaming scanner must hold these characters back: the next chunk may complete the marker.
    """
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def trailing_space(text: str) -> int:
    """Number of trailing whitespace characters of `text`."""
    return len(text) - len(text.rstrip())


class StopMatcher:
    """Finds the first stop string in streamed text (OpenAI semantics: the stop string and all
    text after it are dropped). Text that may be the start of a stop string is held back."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that is now safe to emit; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        self._buf += text
        hits = [pos for stop in self._stops if (pos := self._buf.find(stop)) >= 0]
        if hits:
            out, self._buf = self._buf[: min(hits)], ""
            self.stopped = True
            return out
        hold = max((partial_suffix(self._buf, stop) for stop in self._stops), default=0)
        cut = len(self._buf) - hold
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out
