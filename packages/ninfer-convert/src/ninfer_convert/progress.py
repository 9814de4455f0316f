"""The conversion progress bar: source bytes done / total, rate and ETA, on stderr.

Bytes (not tensors) are the unit because tensor sizes span six orders of magnitude: a norm and
the lm_head would otherwise count the same. The bar stays off when stderr is not a terminal, so
logs and CI output carry no control characters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@contextmanager
def byte_progress(total: int, description: str,
                  console: Console | None = None) -> Iterator[Callable[[int], None]]:
    """Yields `advance(nbytes)`; renders only when the console is a terminal."""
    console = console or Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal,
                  transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)
