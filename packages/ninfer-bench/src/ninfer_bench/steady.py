"""Decode saturation: the steady one-second intervals of a wave of C requests.

The server's interval records (ninfer_runtime/engine/stats.py, served at
/v1/ninfer/intervals) cover whole wall-clock seconds. An interval counts as steady only if all
of the seed's conditions hold:

- it is a complete one-second interval: a whole wall-clock second, with the batch still
  running at its end (the next record has running = C too). The records do not say when in a
  second the batch emptied, and with ignore_eos a wave's requests all finish in one step: the
  second in which they do looks steady by every other condition but is only partly busy;
- no prefill tokens were computed in it;
- running = C, prefilling = 0 and decode_ready = C;
- at least one decode round ended in it, and every round had exactly C rows.

Ramp-up, prefill and drain seconds fail one of these. The aggregate rate is

    steady_decode_tok_s = sum(committed_decode_tokens) / sum(interval_seconds)

and the average batch is the mean number of rows per round over the steady intervals.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

REQUIRED_FIELDS = ("start", "end", "computed_prefill_tokens", "committed_decode_tokens",
                   "running", "prefilling", "decode_ready", "rows_per_round")


class IntervalFieldError(KeyError):
    """The server's interval records lack a field the steady filter needs."""


@dataclass(frozen=True)
class Steady:
    intervals: int
    seconds: float
    decode_tokens: int
    rounds: int
    rows: int

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.seconds if self.seconds else None

    @property
    def avg_batch(self) -> float | None:
        return self.rows / self.rounds if self.rounds else None

    def as_dict(self) -> dict[str, Any]:
        return {"steady_intervals": self.intervals, "steady_s": self.seconds,
                "steady_decode_tokens": self.decode_tokens,
                "steady_decode_tok_s": self.decode_tok_s, "avg_batch": self.avg_batch}


def _check_fields(record: Mapping[str, Any]) -> None:
    missing = [f for f in REQUIRED_FIELDS if f not in record]
    if missing:
        raise IntervalFieldError(f"interval record lacks {missing}: {sorted(record)}")


def is_steady(record: Mapping[str, Any], following: Mapping[str, Any] | None,
              concurrency: int) -> bool:
    """Whether `record` is a steady interval; `following` is the next second's record."""
    rows = record["rows_per_round"]
    return (record["end"] - record["start"] == 1.0
            and following is not None
            and following["start"] == record["end"]
            and following["running"] == concurrency
            and record["computed_prefill_tokens"] == 0
            and record["running"] == concurrency
            and record["prefilling"] == 0
            and record["decode_ready"] == concurrency
            and len(rows) > 0
            and all(r == concurrency for r in rows))


def steady_intervals(records: Sequence[Mapping[str, Any]],
                     concurrency: int) -> list[Mapping[str, Any]]:
    """The steady records among `records` (in any order)."""
    for r in records:
        _check_fields(r)
    ordered = sorted(records, key=lambda r: r["start"])
    return [r for r, following in zip(ordered, [*ordered[1:], None], strict=True)
            if is_steady(r, following, concurrency)]


def steady(records: Sequence[Mapping[str, Any]], concurrency: int) -> Steady:
    """The steady-state aggregate of a wave's interval records."""
    kept = steady_intervals(records, concurrency)
    return Steady(intervals=len(kept),
                  seconds=sum(r["end"] - r["start"] for r in kept),
                  decode_tokens=sum(r["committed_decode_tokens"] for r in kept),
                  rounds=sum(len(r["rows_per_round"]) for r in kept),
                  rows=sum(sum(r["rows_per_round"]) for r in kept))
