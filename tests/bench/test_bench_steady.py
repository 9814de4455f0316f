"""The decode-saturation steady-interval filter on synthetic interval records (the fields of
ninfer_runtime/engine/stats.py)."""

from __future__ import annotations

import pytest

from ninfer_bench.steady import IntervalFieldError, steady, steady_intervals

C = 4


def interval(start: int, *, prefill: int = 0, running: int = C, prefilling: int = 0,
             ready: int = C, rows: list[int] | None = None) -> dict:
    rows = [C] * 10 if rows is None else rows
    return {"start": float(start), "end": float(start + 1), "computed_prefill_tokens": prefill,
            "committed_decode_tokens": sum(rows), "running": running,
            "prefilling": prefilling, "decode_ready": ready, "decode_rounds": len(rows),
            "rows_per_round": rows}


WAVE = [
    interval(100, prefill=1200, prefilling=4, ready=2, rows=[2, 4]),  # ramp-up with prefill
    interval(101, rows=[C] * 12),  # steady: 48 tokens
    interval(102, rows=[C] * 11),  # steady: 44 tokens
    interval(103, rows=[C] * 9 + [3]),  # a request left mid-second: a 3-row round
    interval(104, ready=C - 1, rows=[C] * 5),  # one request not decode-ready at some step
    interval(105, prefilling=1, rows=[C] * 5),  # a prefill step with no prompt tokens counted
    interval(106, rows=[]),  # no decode round
    interval(107, rows=[C] * 10),  # steady: 40 tokens
    interval(108, rows=[C] * 3),  # the wave ends here: all requests finish together
    interval(109, running=0, ready=0, rows=[]),  # idle
]


def test_only_complete_full_batch_decode_seconds_count() -> None:
    kept = steady_intervals(WAVE, C)
    assert [r["start"] for r in kept] == [101.0, 102.0, 107.0]
    result = steady(list(reversed(WAVE)), C)  # order does not matter
    assert (result.intervals, result.seconds, result.decode_tokens) == (3, 3.0, 132)
    assert result.decode_tok_s == pytest.approx(132 / 3)
    assert result.avg_batch == pytest.approx(C)


def test_the_last_record_and_a_gap_are_not_complete() -> None:
    # without the next second's record, nothing shows the batch lasted the whole second
    assert steady_intervals(WAVE[1:2], C) == []
    assert steady_intervals([WAVE[1], interval(103)], C) == []  # 102 missing: not adjacent
    assert len(steady_intervals([WAVE[1], WAVE[2]], C)) == 1


def test_other_concurrency_or_partial_seconds_do_not_count() -> None:
    assert steady_intervals(WAVE, 2) == []
    short = [dict(WAVE[1], end=101.5), WAVE[2], WAVE[3]]
    assert [r["start"] for r in steady_intervals(short, C)] == [102.0]


def test_no_steady_interval_gives_no_rate() -> None:
    result = steady(WAVE[:1], C)
    assert result.intervals == 0 and result.decode_tok_s is None and result.avg_batch is None


def test_a_missing_field_is_named() -> None:
    record = interval(1)
    del record["decode_ready"]
    with pytest.raises(IntervalFieldError, match="decode_ready"):
        steady([record, interval(2)], C)
