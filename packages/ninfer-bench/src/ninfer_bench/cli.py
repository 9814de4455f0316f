"""`ninfer-bench`: the published serving campaign as a tool.

The suites (context, corpus, concurrency, kernels) arrive with the benchmark issue; this entry
point exists so the workspace installs every package's console script from the start.
"""

from __future__ import annotations

import click


@click.group()
def main() -> None:
    """Benchmark NInfer (suites: none yet)."""
