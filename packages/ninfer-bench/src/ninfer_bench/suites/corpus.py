"""`corpus`: the speculative-decode corpus, serially on one server per target.

Three long-reasoning fixtures (thinking on, 65,536-token limit) and twelve cross-scenario
fixtures (thinking off, 4,096-token limit), five seeds each, in fixture order, one request at a
time (stream=false unless --stream). The tables report actual completion lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ninfer_bench.fixtures import CROSS_CATEGORIES, REASONING, corpus, select
from ninfer_bench.metrics import metric_stat, ok, span_s, stat, vllm_summary
from ninfer_bench.suites.common import Job, Point, Run, fixture_jobs

_DECODE = ("decode_tok_s", "spec_acceptance", "spec_tokens_per_round")
DEFAULT_MAX_CONTEXT = 131072  # the seed's refreshed corpus ceiling: 65,536 + the prompt fit


def _row(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    done = ok(records)
    tokens = stat(r["completion_tokens"] for r in done)
    return {"samples": len(done), "failed": len(records) - len(done),
            "completion_tokens": None if tokens is None else tokens.as_dict(),
            **{name: metric_stat(done, name) for name in _DECODE}}


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per long-reasoning fixture and per cross-scenario category (the seed's two tables)."""
    fixtures = dict.fromkeys(r["fixture"] for r in records if r["category"] == REASONING)
    return {
        "fixtures": [{"fixture": f, **_row([r for r in records if r["fixture"] == f])}
                     for f in fixtures],
        "categories": [{"category": c, **_row([r for r in records if r["category"] == c])}
                       for c in CROSS_CATEGORIES if any(r["category"] == c for r in records)],
    }


def jobs(run: Run) -> list[Job]:
    """Every selected fixture with every seed, fixture by fixture."""
    return fixture_jobs(select(corpus(), run.settings.fixtures), run.settings)


def run(run: Run) -> None:
    s = run.settings
    todo = jobs(run)
    max_context = s.max_context or DEFAULT_MAX_CONTEXT
    for target in s.targets:
        point = Point("corpus", target, 1, max_context)
        with run.endpoint(point) as endpoint, run.client(endpoint) as client:
            task = run.progress.add_task(point.label, total=len(todo))
            records = [run.execute(client, endpoint, point, job, task) for job in todo]
        run.writer.add_point({
            "suite": "corpus", "target": target.name, "concurrency": 1,
            "max_context": max_context, "command": endpoint.command, **summarize(records),
            "vllm": vllm_summary(records, span_s(records))})
