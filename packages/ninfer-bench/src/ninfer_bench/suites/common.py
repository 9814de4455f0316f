"""What the suites share: a measured point's endpoint, the warm-up, and one request end to end.

A point is one server configuration (target, concurrency, context ceiling). `Run.endpoint`
starts a fresh ninfer-serve for it (or, with --url, uses the running server), and `Run.execute`
sends one job and turns the reply into the record written to requests.jsonl: what was asked,
what came back, the seed's per-request metrics and the fixture's check.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from rich.progress import Progress, TaskID

from ninfer_bench.client import Client, Reply
from ninfer_bench.fixtures import Fixture
from ninfer_bench.fixtures.checks import check
from ninfer_bench.fixtures.niah import message
from ninfer_bench.metrics import request_metrics
from ninfer_bench.report import RunWriter
from ninfer_bench.server import ServerSpec, running
from ninfer_bench.settings import SAMPLING, Settings, Target
from ninfer_bench.suites.workers import release

WARMUP_WORDS = 900  # about one 1,024-token prefill chunk and a partial one on Qwen's tokenizer
WARMUP_TOKENS = 16


class BenchError(RuntimeError):
    """A point that cannot be measured (its server fails the warm-up)."""


@dataclass(frozen=True)
class Job:
    index: int  # position in the send order
    fixture: Fixture
    seed: int
    ignore_eos: bool = False


@dataclass(frozen=True)
class Point:
    suite: str  # context, corpus, corpus-makespan, decode-saturation
    target: Target
    concurrency: int
    max_context: int

    @property
    def label(self) -> str:
        return f"{self.suite} {self.target.name} C={self.concurrency}"


@dataclass(frozen=True)
class Endpoint:
    url: str
    model: str
    command: str | None  # the ninfer-serve command line; None for a server given by --url


def fixture_jobs(fixtures: Sequence[Fixture], settings: Settings) -> list[Job]:
    """Every fixture with every seed, fixture by fixture, budgets under --max-tokens."""
    pairs = [(replace(f, max_tokens=settings.budget(f.max_tokens)), seed)
             for f in fixtures for seed in settings.seeds]
    return [Job(i, f, seed) for i, (f, seed) in enumerate(pairs)]


def chat_body(job: Job, model: str, sampling: str) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": job.fixture.prompt}],
            "max_tokens": job.fixture.max_tokens, "seed": job.seed,
            "chat_template_kwargs": {"enable_thinking": job.fixture.thinking},
            **SAMPLING[sampling]}
    if job.ignore_eos:
        body["ignore_eos"] = True
    return body


def make_record(point: Point, job: Job, reply: Reply, settings: Settings) -> dict[str, Any]:
    """The requests.jsonl line of one request."""
    usage, ninfer = reply.usage, reply.ninfer
    result = None if reply.error else check(job.fixture.check, reply.content)
    return {
        "suite": point.suite, "target": point.target.name, "mode": settings.mode,
        "sampling": settings.sampling, "concurrency": point.concurrency,
        "index": job.index, "fixture": job.fixture.id, "category": job.fixture.category,
        "seed": job.seed, "max_tokens": job.fixture.max_tokens,
        "thinking": job.fixture.thinking, "status": reply.status, "error": reply.error,
        "finish_reason": reply.finish_reason,
        "prompt_tokens": usage.get("prompt_tokens", ninfer["prompt_tokens"] if ninfer else 0),
        "completion_tokens": usage.get("completion_tokens",
                                       ninfer["completion_tokens"] if ninfer else 0),
        "content": reply.content, "reasoning": reply.reasoning,
        "client": {"start": reply.start, "e2el_s": reply.e2el_s, "ttft_s": reply.ttft_s,
                   "itl_s": reply.itl_s},
        "ninfer": ninfer,
        "metrics": request_metrics(ninfer),
        "check": None if result is None else {"passed": result.passed, "detail": result.detail,
                                              "answer": result.answer},
    }


class Run:
    """One invocation: its settings, its output and its progress bars."""

    def __init__(self, settings: Settings, writer: RunWriter, progress: Progress) -> None:
        self.settings = settings
        self.writer = writer
        self.progress = progress

    def client(self, endpoint: Endpoint) -> Client:
        return Client(endpoint.url, stream=self.settings.stream,
                      timeout_s=self.settings.request_timeout_s)

    @contextmanager
    def endpoint(self, point: Point) -> Iterator[Endpoint]:
        """The point's server, warmed up: a fresh ninfer-serve stopped when the block ends,
        or the server at --url."""
        s = self.settings
        if s.url is not None or point.target.artifact is None:
            url = s.url or ""
            with Client(url) as client:
                endpoint = Endpoint(url, client.model(), None)
            self._warm_up(endpoint, point)
            yield endpoint
            return
        spec = ServerSpec(s.serve, point.target.artifact, point.target.name, s.mode,
                          point.max_context, point.concurrency, s.kv_capacity)
        log = s.output / "logs" / f"{point.suite}-{point.target.name}-c{point.concurrency}.log"
        task = self.progress.add_task(f"starting ninfer-serve for {point.label}", total=None)
        try:
            with running(spec, log, s.startup_timeout_s) as (url, command):
                self.progress.remove_task(task)
                endpoint = Endpoint(url, point.target.name, command)
                self._warm_up(endpoint, point)
                yield endpoint
        finally:
            if task in self.progress.task_ids:
                self.progress.remove_task(task)

    def _warm_up(self, endpoint: Endpoint, point: Point) -> None:
        """C requests at once, each a prefill chunk or so and a few decode steps, so that
        compilation, autotuning and graph capture at this batch size happen before measuring."""
        words = min(WARMUP_WORDS, point.max_context // 8)
        fixture = Fixture("warm-up", "warm-up", message(words, "warm-up"), thinking=False,
                          max_tokens=WARMUP_TOKENS, check={"kind": "needle", "needle": ""})
        replies: list[Reply] = []

        def one(seed: int) -> None:
            with self.client(endpoint) as client:
                replies.append(client.chat(chat_body(Job(-1, fixture, seed), endpoint.model,
                                                     self.settings.sampling)))

        release([partial(one, seed) for seed in range(point.concurrency)])
        failed = [r.error for r in replies if r.error]
        if failed:
            raise BenchError(f"{point.label}: the warm-up failed: {failed[0]}")

    def execute(self, client: Client, endpoint: Endpoint, point: Point, job: Job,
                task: TaskID) -> dict[str, Any]:
        """Send `job`, record it, advance the point's progress bar; the record."""
        reply = client.chat(chat_body(job, endpoint.model, self.settings.sampling))
        record = make_record(point, job, reply, self.settings)
        self.writer.add(record)
        self.progress.advance(task)
        return record
