"""`ninfer-bench kernels`: every row a suite yields is in the report as soon as it is measured,
so a suite cut short (a time limit, an error) keeps the rows before it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import Result

from ninfer_bench import kernels


def test_a_failing_suite_keeps_the_rows_it_measured(
        bench: Callable[..., Result], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    written: list[int] = []

    def partial(device: str = "cuda") -> Iterator[dict]:
        yield {"op": "first", "shape": "a", "time_us": 1.0}
        written.append(len(json.loads((tmp_path / "kernels.json").read_text())["rows"]))
        raise RuntimeError("cut")

    monkeypatch.setattr(kernels, "suites", lambda: {"partial": partial,
                                                    "whole": lambda device: [{"op": "w"}]})
    result = bench("kernels", "--device", "cpu", "--output", tmp_path)
    assert result.exit_code == 0, result.output
    assert written == [1]  # the first row was on disk before the suite went on
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert [(r["suite"], r["op"]) for r in rows] == [("partial", "first"), ("partial", "error"),
                                                     ("whole", "w")]
    assert "RuntimeError: cut" in rows[1]["shape"]
    assert "| partial | first | a |" in (tmp_path / "kernels.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.json", "kernels.md"]
