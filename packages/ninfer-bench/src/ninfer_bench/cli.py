"""`ninfer-bench`: the published serving campaign as a tool.

Implemented so far: `kernels` (per-op microbenchmarks against their ceilings). The serving
suites (context, corpus, concurrency) arrive with the benchmark issue.
"""

from __future__ import annotations

import json
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import click


@click.group()
def main() -> None:
    """Benchmark NInfer."""


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _markdown(rows: list[dict]) -> str:
    cols = ["suite", "op", "shape", "time_us", "ratio_to_ceiling", "ceiling"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r.get(c, "") for c in cols]
        lines.append("| " + " | ".join(
            f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


@main.command()
@click.option("--only", multiple=True, help="Run only these suites (module names).")
@click.option("--device", default="cuda", show_default=True)
@click.option("--output", type=click.Path(file_okay=False, path_type=Path),
              default=Path("out/bench"), show_default=True)
def kernels(only: tuple[str, ...], device: str, output: Path) -> None:
    """Per-op kernel microbenchmarks against their bandwidth or FLOP ceiling."""
    import torch

    from ninfer_bench.kernels import suites

    available = suites()
    unknown = set(only) - set(available)
    if unknown:
        raise click.ClickException(f"unknown suites {sorted(unknown)}; known: {sorted(available)}")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    report = {"gpu": gpu, "commit": _commit(), "date": datetime.now(timezone.utc).isoformat(),
              "rows": []}
    rows = report["rows"]
    output.mkdir(parents=True, exist_ok=True)
    for name, bench in available.items():
        if only and name not in only:
            continue
        click.echo(f"running {name} ...", err=True)
        try:
            rows += [{"suite": name, **row} for row in bench(device=device)]
        except Exception as e:  # noqa: BLE001 - one failing suite must not lose the others
            rows.append({"suite": name, "op": "error", "shape": f"{type(e).__name__}: {e}"})
        # written after every suite, so an interrupted run keeps what it measured
        (output / "kernels.json").write_text(json.dumps(report, indent=1))
        (output / "kernels.md").write_text(
            f"GPU {gpu}, commit {report['commit']}, {report['date']}\n\n" + _markdown(rows))
    click.echo(_markdown(rows))


if __name__ == "__main__":
    main()
