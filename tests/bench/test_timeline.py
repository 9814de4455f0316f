"""ninfer_bench.timeline: busy time is the union of the device's activities, and each idle gap
is named by the activity that ended last before it and the one after it."""

from __future__ import annotations

import pytest

from ninfer_bench.timeline import Activity, Gap, timeline


def test_overlapping_activities_count_once_and_gaps_are_named() -> None:
    acts = [
        ("graph_a", 0.0, 100.0), ("graph_b", 50.0, 120.0),  # overlap: busy 0-120
        ("copy", 130.0, 132.0),  # 10 us after graph_b, which ended last
        ("sample", 132.5, 140.0),  # 0.5 us: idle, but under the threshold
        ("graph_a", 150.0, 250.0), ("tiny", 160.0, 170.0),  # inside graph_a's interval
        ("copy", 260.0, 262.0),  # 10 us after graph_a, not after "tiny"
    ]
    t = timeline(acts, steps=2)
    assert t.span_us == 262.0
    assert t.busy_us == pytest.approx(120 + 2 + 7.5 + 100 + 2)
    assert t.step_us == 131.0 and t.idle_us_a_step == pytest.approx((262 - 231.5) / 2)
    assert t.gaps == [Gap("graph_a", "copy", 1, 10.0), Gap("graph_b", "copy", 1, 10.0),
                      Gap("sample", "graph_a", 1, 10.0)]


def test_repeated_gaps_are_summed_largest_first() -> None:
    acts = [("step", 0.0, 10.0), ("read", 15.0, 16.0), ("step", 40.0, 50.0),
            ("read", 55.0, 56.0), ("step", 80.0, 90.0)]
    t = timeline(acts, steps=3, min_gap_us=2.0)
    assert t.gaps == [Gap("read", "step", 2, 48.0), Gap("step", "read", 2, 10.0)]
    # at most twice a step: all three kinds here ("step" 3 times in 3 steps)
    assert t.rare == [Activity("step", 3, 30.0), Activity("read", 2, 2.0)]
    many = timeline([("layer", 10.0 * i, 10.0 * i + 9) for i in range(7)] + [("copy", 70, 72)],
                    steps=3)
    assert many.rare == [Activity("copy", 1, 2.0)]  # "layer" runs 7 times in 3 steps
    with pytest.raises(ValueError, match="no device activity"):
        timeline([], steps=1)


def test_the_engine_bench_prints_the_timeline() -> None:
    from dataclasses import asdict

    from ninfer_bench.engine_bench import markdown

    t = asdict(timeline([("graph", 0.0, 100.0), ("copy", 110.0, 112.0), ("graph", 115.0, 200.0)],
                        steps=2))
    text = markdown({"artifact": "a", "spec": "none", "startup_s": 1.0, "rows": [],
                     "breakdown": {}, "timeline": {"decode ctx8_c1": t, "decode ctx8_c2": None},
                     "host": {}})
    assert ("decode ctx8_c1, the device's timeline over 2 steps: 100.0 us a step, the GPU busy "
            "93.5 and idle 6.5") in text
    assert "| `graph` | `copy` | 1 | 5.0 |" in text and "| `copy` | `graph` | 1 | 1.5 |" in text
    assert "| `graph` | 1.00 | 92.5 |" in text and "| `copy` | 0.50 | 1.0 |" in text
    assert "ctx8_c2" not in text  # no timeline off a GPU
