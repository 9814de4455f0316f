"""`concurrency --suite corpus-makespan`: the whole corpus through exactly C persistent workers.

The fixed request set (every selected fixture with every seed: 75 requests by default) is
shuffled once with seed 20260811 and sent in that order at every C: each worker takes the next
request only after reading its current response. A fresh server per C (max_concurrency = C).
Makespan runs from the workers' release to the last complete response; prefill and decode
rates divide the server's token totals by it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from ninfer_bench.client import Client
from ninfer_bench.metrics import makespan_summary, vllm_summary
from ninfer_bench.suites import corpus
from ninfer_bench.suites.common import Endpoint, Job, Point, Run
from ninfer_bench.suites.workers import release

SHUFFLE_SEED = 20260811


def shuffled(jobs: Sequence[Job], seed: int = SHUFFLE_SEED) -> list[Job]:
    """`jobs` in the fixed send order, renumbered. Fisher-Yates over Random.random(), whose
    sequence Python guarantees across versions (random.shuffle's is not guaranteed)."""
    order = list(jobs)
    rng = random.Random(seed)
    for i in range(len(order) - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return [replace(job, index=i) for i, job in enumerate(order)]


def _measure(run: Run, point: Point, endpoint: Endpoint,
             order: Sequence[Job]) -> tuple[list[dict[str, Any]], float]:
    pending = iter(order)
    lock = threading.Lock()
    records: list[dict[str, Any]] = []
    task = run.progress.add_task(point.label, total=len(order))

    def worker(client: Client) -> None:
        while True:
            with lock:
                job = next(pending, None)
            if job is None:
                return
            record = run.execute(client, endpoint, point, job, task)
            with lock:
                records.append(record)

    clients = [run.client(endpoint) for _ in range(point.concurrency)]
    try:
        makespan = release([partial(worker, c) for c in clients])
    finally:
        for c in clients:
            c.close()
    return sorted(records, key=lambda r: r["index"]), makespan


def run(run: Run, concurrency: Sequence[int]) -> None:
    s = run.settings
    order = shuffled(corpus.jobs(run))
    max_context = s.max_context or corpus.DEFAULT_MAX_CONTEXT
    for target in s.targets:
        for c in concurrency:
            point = Point("corpus-makespan", target, c, max_context)
            with run.endpoint(point) as endpoint:
                records, makespan = _measure(run, point, endpoint, order)
            run.writer.add_point({
                "suite": "corpus-makespan", "target": target.name, "concurrency": c,
                "max_context": max_context, "command": endpoint.command,
                "send_order": [f"{j.fixture.id}#{j.seed}" for j in order],
                "makespan": makespan_summary(records, makespan), **corpus.summarize(records),
                "vllm": vllm_summary(records, makespan)})
