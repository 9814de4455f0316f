"""`ninfer-bench context | corpus | concurrency`: the seed's serving campaign (performance.md).

Each command starts a fresh ninfer-serve per measured point (or measures the server at --url),
writes its results under --output as it goes (report.py), and stops every server it started,
also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from ninfer_bench.client import ClientError
from ninfer_bench.fixtures import FixtureError, seeds
from ninfer_bench.fixtures.niah import CONTEXT_LENGTHS
from ninfer_bench.machine import commit, describe_artifact, gpu_name
from ninfer_bench.report import RunWriter
from ninfer_bench.server import ServerError
from ninfer_bench.settings import MODES, SAMPLING, Settings, Target
from ninfer_bench.suites import context, corpus, makespan, saturation
from ninfer_bench.suites.common import BenchError, Run

SUITES = ("corpus-makespan", "decode-saturation")
DEFAULT_CONCURRENCY = (1, 2, 4, 8)


def _artifact(_: click.Context, __: click.Parameter, values: tuple[str, ...]) -> list[Target]:
    targets = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"expected NAME=PATH, got {value!r}")
        if not Path(path).is_file():
            raise click.BadParameter(f"{path}: no such artifact file")
        targets.append(Target(name, Path(path)))
    return targets


def _ints(_: click.Context, __: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        ints = [int(v) for v in value.split(",") if v.strip()]
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from e
    if not ints or min(ints) < 1:
        raise click.BadParameter(f"expected positive integers, got {value!r}")
    return ints


def _names(_: click.Context, __: click.Parameter, value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _kv_capacity(_: click.Context, __: click.Parameter, value: str) -> str:
    if value != "auto" and not value.isdigit():
        raise click.BadParameter(f"expected 'auto' or a number of tokens, got {value!r}")
    return value


_OPTIONS = (
    click.option("--serve", default="ninfer-serve", show_default=True,
                 help="The ninfer-serve command, split like a shell line (extra flags allowed)."),
    click.option("--artifact", "artifacts", multiple=True, callback=_artifact,
                 metavar="NAME=PATH", help="An artifact to measure (repeatable)."),
    click.option("--url", default=None,
                 help="Measure this running OpenAI-compatible server instead of starting one."),
    click.option("--mode", type=click.Choice(list(MODES)), default="mtp0", show_default=True),
    click.option("--sampling", type=click.Choice(list(SAMPLING)), default="stochastic",
                 show_default=True),
    click.option("--max-context", type=click.IntRange(min=2), default=None,
                 help="The server's per-request context ceiling (default: the suite's)."),
    click.option("--kv-capacity", default="auto", show_default=True, callback=_kv_capacity),
    click.option("--output", type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="Results folder (default out/bench/SUITE-TIMESTAMP)."),
    click.option("--fixtures", callback=_names, default=None,
                 help="Comma-separated fixture ids or categories (default: all)."),
    click.option("--seeds", "seed_count", type=click.IntRange(1, 5), default=5,
                 show_default=True, help="How many of the five fixed seeds."),
    click.option("--max-tokens", type=click.IntRange(min=1), default=None,
                 help="Cap every output budget (to run small anywhere)."),
    click.option("--stream/--no-stream", default=False, show_default=True,
                 help="Stream responses (client-side TTFT and ITL)."),
    click.option("--startup-timeout", type=float, default=1800.0, show_default=True,
                 help="Seconds a server may take to become healthy."),
    click.option("--request-timeout", type=float, default=7200.0, show_default=True),
)


def serving_options(fn: Callable[..., None]) -> Callable[..., None]:
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


def _settings(suite: str, o: dict[str, Any]) -> Settings:
    if bool(o["artifacts"]) == bool(o["url"]):
        raise click.UsageError("give --artifact NAME=PATH (repeatable) or --url URL")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Settings(
        serve=tuple(shlex.split(o["serve"])), url=o["url"],
        targets=tuple(o["artifacts"]) or (Target("server", None),),
        mode=o["mode"], sampling=o["sampling"], max_context=o["max_context"],
        kv_capacity=o["kv_capacity"], output=o["output"] or Path("out/bench", f"{suite}-{stamp}"),
        fixtures=o["fixtures"], seeds=seeds(o["seed_count"]), max_tokens=o["max_tokens"],
        stream=o["stream"], startup_timeout_s=o["startup_timeout"],
        request_timeout_s=o["request_timeout"])


def _meta(suite: str, s: Settings) -> dict[str, Any]:
    targets = [{"name": t.name, "artifact": str(t.artifact) if t.artifact else None,
                "description": describe_artifact(t.artifact) if t.artifact
                else f"the server at {s.url}"} for t in s.targets]
    return {"suite": suite, "argv": sys.argv, "commit": commit(), "gpu": gpu_name(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "mode": s.mode, "sampling": s.sampling, "sampling_params": SAMPLING[s.sampling],
            "stream": s.stream, "seeds": list(s.seeds), "max_tokens": s.max_tokens,
            "fixtures": list(s.fixtures), "url": s.url, "kv_capacity": s.kv_capacity,
            "targets": targets}


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, through the `finally` that stops the servers."""
    def handler(signum: int, _: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(suite: str, options: dict[str, Any], body: Callable[[Run], None]) -> None:
    try:
        settings = _settings(suite, options)
    except FixtureError as e:
        raise click.UsageError(str(e)) from e
    writer = RunWriter(settings.output, _meta(suite, settings))
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True))
    try:
        with _sigterm_as_exit(), progress:
            body(Run(settings, writer, progress))
    except (ServerError, BenchError, ClientError, FixtureError, httpx.HTTPError) as e:
        raise click.ClickException(f"{type(e).__name__}: {e}") from e
    finally:
        writer.save()
        writer.close()
        click.echo(f"results: {settings.output}", err=True)


@click.command("context")
@serving_options
@click.option("--context-lengths", callback=_ints, default=None,
              help="NIAH context lengths (default 8192,65536,131072,262144).")
def context_command(context_lengths: list[int] | None, **options: Any) -> None:
    """Long NIAH prompts: prefill tok/s, server TTFT and decode tok/s against context length."""
    _run("context", options,
         lambda run: context.run(run, context_lengths or list(CONTEXT_LENGTHS)))


@click.command("corpus")
@serving_options
def corpus_command(**options: Any) -> None:
    """The long-reasoning and cross-scenario corpus, one request at a time."""
    _run("corpus", options, corpus.run)


@click.command("concurrency")
@serving_options
@click.option("--suite", type=click.Choice(SUITES), default="corpus-makespan",
              show_default=True)
@click.option("--concurrency", multiple=True, type=click.IntRange(min=1),
              help="C (repeatable; default 1, 2, 4, 8).")
@click.option("--decode-tokens", type=click.IntRange(min=2),
              default=saturation.DEFAULT_DECODE_TOKENS, show_default=True,
              help="Output budget of each decode-saturation request.")
def concurrency_command(suite: str, concurrency: tuple[int, ...], decode_tokens: int,
                        **options: Any) -> None:
    """The corpus through C persistent workers, or decode saturation with C requests."""
    levels = sorted(set(concurrency or DEFAULT_CONCURRENCY))
    if suite == "corpus-makespan":
        _run("concurrency", options, lambda run: makespan.run(run, levels))
    else:
        _run("concurrency", options, lambda run: saturation.run(run, levels, decode_tokens))


COMMANDS = (context_command, corpus_command, concurrency_command)
