"""`concurrency --suite decode-saturation`: C long requests released together, and the server's
steady one-second intervals (steady.py) of the wave.

One long-reasoning fixture (thinking on), C distinct fixed seeds, a --decode-tokens budget
(8,192 by default) and a fresh server per C with max_concurrency = C. Requests set ignore_eos so
that each decodes its full budget: the seed's waves all reached their limit, and on random-init
weights an early end-of-sequence would otherwise empty the batch. The interval records are
fetched every POLL_S while the wave runs (the server keeps only the last ten minutes) and once
more after its last second is complete.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import replace
from functools import partial
from typing import Any

import httpx

from ninfer_bench.client import Client, ClientError
from ninfer_bench.fixtures import Fixture, corpus, select
from ninfer_bench.metrics import spec_acceptance, vllm_summary
from ninfer_bench.steady import IntervalFieldError, steady
from ninfer_bench.suites.common import Endpoint, Job, Point, Run
from ninfer_bench.suites.workers import release

FIXTURE = "long_decode_math_02"
WAVE_SEED = 20260811  # request i of a wave samples with WAVE_SEED + i
DEFAULT_DECODE_TOKENS = 8192
DEFAULT_MAX_CONTEXT = 16384
POLL_S = 60.0


class _Intervals:
    """The wave's interval records, merged by start second (a later fetch wins: a record can
    still change while a step that overlaps it runs)."""

    def __init__(self, client: Client, since: float) -> None:
        self._client = client
        self._since = since
        self.records: dict[float, dict[str, Any]] | None = {}

    def fetch(self) -> None:
        if self.records is None:
            return
        got = self._client.intervals(self._since)
        if got is None:
            self.records = None  # not ninfer-serve
            return
        self.records.update({r["start"]: r for r in got})

    def poll(self, done: threading.Event) -> None:
        while not done.wait(POLL_S):
            with suppress(ClientError, httpx.HTTPError):  # the fetch after the wave reports it
                self.fetch()


def _wave(run: Run, point: Point, endpoint: Endpoint,
          jobs: Sequence[Job]) -> tuple[list[dict[str, Any]], float, list | None]:
    task = run.progress.add_task(point.label, total=len(jobs))
    records: list[dict[str, Any]] = []
    clients = [run.client(endpoint) for _ in jobs]
    observer = run.client(endpoint)
    intervals = _Intervals(observer, math.floor(time.time()))
    done = threading.Event()
    poller = threading.Thread(target=intervals.poll, args=(done,), daemon=True)
    poller.start()
    try:
        def one(client: Client, job: Job) -> None:
            records.append(run.execute(client, endpoint, point, job, task))

        makespan = release([partial(one, c, j) for c, j in zip(clients, jobs, strict=True)])
        done.set()
        poller.join()
        end = max(r["client"]["start"] + r["client"]["e2el_s"] for r in records)
        time.sleep(max(0.0, math.floor(end) + 1.05 - time.time()))  # its last second complete
        intervals.fetch()
    finally:
        done.set()
        for c in (*clients, observer):
            c.close()
    kept = None if intervals.records is None else [intervals.records[k]
                                                   for k in sorted(intervals.records)]
    return sorted(records, key=lambda r: r["index"]), makespan, kept


def summarize(records: Sequence[dict[str, Any]], makespan: float,
              intervals: Sequence[dict[str, Any]] | None, concurrency: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "wave_makespan_s": makespan, "requests": len(records),
        "completion_tokens": sum(r["completion_tokens"] for r in records),
        "finish_reasons": sorted({str(r["finish_reason"]) for r in records}),
        "spec_acceptance": spec_acceptance(records),
        "steady_error": None,
    }
    if intervals is None:
        out["steady_error"] = "the server reports no interval records (/v1/ninfer/intervals)"
        return out
    try:
        return out | steady(intervals, concurrency).as_dict()
    except IntervalFieldError as e:
        out["steady_error"] = str(e)
        return out


def wave_fixture(run: Run, decode_tokens: int) -> Fixture:
    """The first fixture --fixtures names (default FIXTURE) with the decode budget."""
    s = run.settings
    base = select(corpus(), s.fixtures[:1] or (FIXTURE,))[0]
    return replace(base, max_tokens=s.budget(decode_tokens))


def run(run: Run, concurrency: Sequence[int], decode_tokens: int) -> None:
    s = run.settings
    fixture = wave_fixture(run, decode_tokens)
    max_context = s.max_context or DEFAULT_MAX_CONTEXT
    for target in s.targets:
        for c in concurrency:
            point = Point("decode-saturation", target, c, max_context)
            jobs = [Job(i, fixture, WAVE_SEED + i, ignore_eos=True) for i in range(c)]
            with run.endpoint(point) as endpoint:
                records, makespan, intervals = _wave(run, point, endpoint, jobs)
            run.writer.add_point({
                "suite": "decode-saturation", "target": target.name, "concurrency": c,
                "max_context": max_context, "command": endpoint.command,
                "fixture": fixture.id, "decode_tokens": fixture.max_tokens,
                "saturation": summarize(records, makespan, intervals, c),
                "intervals": intervals, "vllm": vllm_summary(records, makespan)})
