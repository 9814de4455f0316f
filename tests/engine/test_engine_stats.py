"""One-second interval records, with explicit step times."""

from __future__ import annotations

from ninfer_runtime.engine.stats import IntervalRecorder, StepRecord


def step(start: float, end: float, prefill: int, decode: int, running: int, prefilling: int,
         decode_ready: int, rows: int | None = None) -> StepRecord:
    """rows: requests that got tokens (default: one token each, as without spec)."""
    return StepRecord(start, end, prefill, decode, decode if rows is None else rows, running,
                      prefilling, decode_ready)


def test_records_count_steps_by_the_second_they_end_in() -> None:
    rec = IntervalRecorder()
    assert rec.complete(100.0) == []
    rec.record(step(100.2, 100.4, 10, 0, running=1, prefilling=1, decode_ready=0))
    rec.record(step(100.4, 100.9, 5, 2, running=2, prefilling=1, decode_ready=1))
    rec.record(step(100.9, 102.3, 0, 2, running=2, prefilling=0, decode_ready=2))  # 2 s long
    assert rec.complete(101.5) == [{
        "start": 100.0, "end": 101.0, "computed_prefill_tokens": 15,
        "committed_decode_tokens": 2, "running": 2, "prefilling": 1, "decode_ready": 2,
        "decode_rounds": 1, "rows_per_round": [2]}]
    records = rec.complete(104.2)
    assert [r["start"] for r in records] == [100.0, 101.0, 102.0, 103.0]  # contiguous
    long_step, ended, idle = records[1], records[2], records[3]
    assert (long_step["running"], long_step["committed_decode_tokens"]) == (2, 0)
    assert (ended["committed_decode_tokens"], ended["rows_per_round"]) == (2, [2])
    assert idle == {"start": 103.0, "end": 104.0, "computed_prefill_tokens": 0,
                    "committed_decode_tokens": 0, "running": 0, "prefilling": 0,
                    "decode_ready": 0, "decode_rounds": 0, "rows_per_round": []}
    assert [r["start"] for r in rec.complete(104.2, since=102.0)] == [102.0, 103.0]


def test_old_records_are_dropped() -> None:
    rec = IntervalRecorder(retention_s=5)
    rec.record(step(10.0, 10.5, 1, 1, 1, 0, 1))
    rec.record(step(12.0, 12.5, 0, 1, 1, 0, 1))
    assert [r["start"] for r in rec.complete(13.0)] == [10.0, 11.0, 12.0]
    assert [r["start"] for r in rec.complete(17.5)] == [12.0, 13.0, 14.0, 15.0, 16.0]
    rec.record(step(500.0, 500.1, 0, 3, 1, 0, 1))  # after a long idle time
    records = rec.complete(501.0)
    assert [r["start"] for r in records] == [496.0, 497.0, 498.0, 499.0, 500.0]
    assert sum(r["committed_decode_tokens"] for r in records) == 3


def test_speculative_rounds_count_requests_not_tokens() -> None:
    rec = IntervalRecorder()
    rec.record(step(7.1, 7.2, 0, 7, running=2, prefilling=0, decode_ready=2, rows=2))
    rec.record(step(7.2, 7.3, 0, 2, running=2, prefilling=0, decode_ready=2, rows=2))
    [record] = rec.complete(8.0)
    assert record["rows_per_round"] == [2, 2] and record["committed_decode_tokens"] == 9
