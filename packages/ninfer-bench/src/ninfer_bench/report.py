"""A run's output folder, kept current as the run goes (an interrupted run keeps what it
measured):

- requests.jsonl   one line per request, appended as each completes (suites/common.py);
- summary.json     the run's settings and machine, every point's summary (with vLLM's keys)
                   and the audit;
- report.md        the seed's tables (tables.py) and the audit (audit.py);
- *.png            plots (plots.py);
- logs/            each server's output.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ninfer_bench import audit, plots, tables


class RunWriter:
    def __init__(self, output: Path, meta: Mapping[str, Any]) -> None:
        output.mkdir(parents=True, exist_ok=True)
        self.output = output
        self.meta = dict(meta)
        self.records: list[dict[str, Any]] = []
        self.points: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._jsonl = open(output / "requests.jsonl", "w", encoding="utf-8")  # noqa: SIM115

    def add(self, record: dict[str, Any]) -> None:
        """Record one request (thread-safe: the concurrency workers call it)."""
        with self._lock:
            self.records.append(record)
            self._jsonl.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._jsonl.flush()

    def add_point(self, summary: dict[str, Any]) -> None:
        """Record a measured point and rewrite the summary, report and plots."""
        self.points.append(summary)
        self.save()

    def save(self) -> None:
        with self._lock:
            entries = audit.audit(self.records)
        written = plots.plot(self.points, self.output)
        summary = {"meta": self.meta, "points": self.points, "audit": entries, "plots": written}
        (self.output / "summary.json").write_text(json.dumps(summary, indent=1,
                                                             ensure_ascii=False))
        figures = (["(no plots: matplotlib is not importable)"] if written is None
                   else [f"![{name}]({name})" for name in written])
        text = "\n".join([tables.report(self.meta, self.points), audit.markdown(entries),
                          "## Plots", "", *figures, ""])
        (self.output / "report.md").write_text(text, encoding="utf-8")

    def close(self) -> None:
        self._jsonl.close()
