"""One-second interval records of the engine's work (what ninfer-bench reads steady state from).

Records cover whole wall-clock seconds [t, t+1) (time.time(), so other processes can line them
up with their own clocks), contiguous from the first step on, idle seconds included:

- computed_prefill_tokens, committed_decode_tokens: prompt tokens computed and tokens generated
  (the first token of a request included) by the steps that ended in the interval;
- decode_rounds, rows_per_round: the steps that ended in the interval with at least one token
  generated, and how many requests each generated tokens for (its rows: one token each, or
  up to K+1 each with speculative decoding);
- running, prefilling, decode_ready: the largest batch composition of any step overlapping the
  interval (a maximum, so a second in which requests came and went shows its peak).

Records older than `retention_s` are dropped.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

DEFAULT_RETENTION_S = 600


@dataclass
class _Interval:
    start: int
    computed_prefill_tokens: int = 0
    committed_decode_tokens: int = 0
    running: int = 0
    prefilling: int = 0
    decode_ready: int = 0
    rows_per_round: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"start": float(self.start), "end": float(self.start + 1),
                "computed_prefill_tokens": self.computed_prefill_tokens,
                "committed_decode_tokens": self.committed_decode_tokens,
                "running": self.running, "prefilling": self.prefilling,
                "decode_ready": self.decode_ready, "decode_rounds": len(self.rows_per_round),
                "rows_per_round": list(self.rows_per_round)}


@dataclass(frozen=True, slots=True)
class StepRecord:
    start: float  # wall-clock seconds
    end: float
    prefill_tokens: int
    decode_tokens: int
    decode_rows: int  # requests that got tokens
    running: int
    prefilling: int
    decode_ready: int


class IntervalRecorder:
    def __init__(self, retention_s: int = DEFAULT_RETENTION_S):
        self.retention_s = retention_s
        self._records: deque[_Interval] = deque()

    def _through(self, second: int) -> None:
        """Create the (empty) records up to and including `second`."""
        if self._records and second - self._records[-1].start > self.retention_s:
            self._records.clear()  # idle for longer than the retention: start afresh
            self._records.append(_Interval(second - self.retention_s))
        if not self._records:
            self._records.append(_Interval(second))
        while self._records[-1].start < second:
            self._records.append(_Interval(self._records[-1].start + 1))
        while self._records[0].start < second - self.retention_s:
            self._records.popleft()

    def _at(self, second: int) -> _Interval:
        return self._records[second - self._records[0].start]

    def record(self, step: StepRecord) -> None:
        first, last = math.floor(step.start), math.floor(step.end)
        if self._records:  # the wall clock may step back: never rewrite the past
            last = max(last, self._records[-1].start)
        self._through(last)
        for second in range(max(first, self._records[0].start), last + 1):
            r = self._at(second)
            r.running = max(r.running, step.running)
            r.prefilling = max(r.prefilling, step.prefilling)
            r.decode_ready = max(r.decode_ready, step.decode_ready)
        r = self._at(last)
        r.computed_prefill_tokens += step.prefill_tokens
        r.committed_decode_tokens += step.decode_tokens
        if step.decode_rows:
            r.rows_per_round.append(step.decode_rows)

    def complete(self, now: float, since: float | None = None) -> list[dict[str, Any]]:
        """The records that ended by `now` and start at or after `since`."""
        if not self._records:
            return []
        current = math.floor(now)
        self._through(current)
        return [r.as_dict() for r in self._records
                if r.start < current and (since is None or r.start >= since)]
