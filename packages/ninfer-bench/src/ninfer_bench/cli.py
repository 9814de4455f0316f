"""`ninfer-bench`: the published serving campaign as a tool.

`context`, `corpus` and `concurrency` are the seed's serving suites (commands.py); `kernels` runs
the per-op microbenchmarks against their ceilings.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import click

from ninfer_bench.ceilings import Ceilings
from ninfer_bench.commands import COMMANDS
from ninfer_bench.machine import commit as _commit
from ninfer_runtime.engine.config import EngineConfig


@click.group()
def main() -> None:
    """Benchmark NInfer."""


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

    from ninfer_bench.ceilings import ceilings
    from ninfer_bench.kernels import suites

    available = suites()
    unknown = set(only) - set(available)
    if unknown:
        raise click.ClickException(f"unknown suites {sorted(unknown)}; known: {sorted(available)}")
    if torch.device(device).index is not None and torch.cuda.is_available():
        # the suites' ratios (`against_bandwidth`) and this header take the current device
        torch.cuda.set_device(torch.device(device))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    report = {"gpu": gpu, "commit": _commit(), "date": datetime.now(timezone.utc).isoformat(),
              "ceilings": asdict(ceilings(device)), "rows": []}
    rows = report["rows"]
    output.mkdir(parents=True, exist_ok=True)
    for name, bench in available.items():
        if only and name not in only:
            continue
        click.echo(f"running {name} ...", err=True)
        try:
            for row in bench(device=device):
                rows.append({"suite": name, **row})
                _write_kernels(output, report)  # an interrupted run keeps what it measured
        except Exception as e:  # noqa: BLE001 - one failing suite must not lose the others
            rows.append({"suite": name, "op": "error", "shape": f"{type(e).__name__}: {e}"})
        _write_kernels(output, report)
    click.echo(_markdown(rows))


def _write_kernels(output: Path, report: dict) -> None:
    """The report so far; each file replaced whole, so that a run killed while writing leaves
    the previous version, never half a file."""
    md = (f"GPU {report['gpu']}, commit {report['commit']}, {report['date']}; "
          f"{Ceilings(**report['ceilings']).describe()}\n\n")
    for name, text in (("kernels.json", json.dumps(report, indent=1)),
                       ("kernels.md", md + _markdown(report["rows"]))):
        tmp = output / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, output / name)


def _ints(_: click.Context, __: click.Parameter, value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v]
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from e


@main.command()
@click.argument("artifact", type=click.Path(exists=True, dir_okay=False))
@click.option("--context-lengths", default="8192", callback=_ints, show_default=True)
@click.option("--concurrency", default="1,8", callback=_ints, show_default=True)
@click.option("--decode-tokens", default=128, show_default=True)
@click.option("--kv-dtype", type=click.Choice(["int8", "bf16"]), default="int8")
@click.option("--prefill-chunk", default=1024, show_default=True,
              help="Prompt tokens per request per step (the engine's --prefill-chunk; 1,024 as "
              "the published campaign ran, where the engine's default is 8,192).")
@click.option("--max-batched-tokens", default=None, type=int,
              help="Tokens per step over every request (the engine's default if not given).")
@click.option("--no-cuda-graph", "no_cuda_graph", is_flag=True)
@click.option("--prompt-graphs/--no-prompt-graphs", default=EngineConfig.prompt_graphs,
              show_default=True,
              help="Replay lone short prompt chunks as CUDA graphs (the engine's flag).")
@click.option("--no-overlap-decode", "no_overlap_decode", is_flag=True,
              help="Read each decode step's tokens before launching the next.")
@click.option("--no-breakdown", "no_breakdown", is_flag=True)
@click.option("--timeline", "device_timeline", is_flag=True,
              help="The device's timeline over graphed decode steps even with --no-breakdown "
                   "(the breakdown takes it too): where the GPU idles between them.")
@click.option("--spec", type=click.Choice(["none", "mtp", "dflash"]), default="none",
              show_default=True, help="Speculative mode: a decode step is then one round.")
@click.option("--draft-tokens", default=3, show_default=True)
@click.option("--lm-head-draft", is_flag=True)
@click.option("--device", default="cuda", show_default=True)
@click.option("--output", type=click.Path(file_okay=False, path_type=Path),
              default=Path("out/bench"), show_default=True)
def engine(artifact: str, context_lengths: list[int], concurrency: list[int],
           decode_tokens: int, kv_dtype: str, prefill_chunk: int,
           max_batched_tokens: int | None, no_cuda_graph: bool, prompt_graphs: bool,
           no_overlap_decode: bool,
           no_breakdown: bool, device_timeline: bool, spec: str, draft_tokens: int,
           lm_head_draft: bool, device: str, output: Path) -> None:
    """In-process prefill and decode throughput of ARTIFACT against its ceilings."""
    import torch

    from ninfer_bench.engine_bench import markdown, run

    report = run(artifact, contexts=context_lengths, concurrency=concurrency,
                 decode_tokens=decode_tokens, device=device, kv_dtype=kv_dtype,
                 prefill_chunk=prefill_chunk, max_batched_tokens=max_batched_tokens,
                 cuda_graphs=not no_cuda_graph, prompt_graphs=prompt_graphs,
                 overlap_decode=not no_overlap_decode,
                 breakdown=not no_breakdown, device_timeline=device_timeline, spec=spec,
                 draft_tokens=draft_tokens, lm_head_draft=lm_head_draft)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    report |= {"gpu": gpu, "commit": _commit(), "date": datetime.now(timezone.utc).isoformat()}
    output.mkdir(parents=True, exist_ok=True)
    stem = output / f"engine-{Path(artifact).stem}-{report['spec'].replace(' ', '-')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    text = f"GPU {gpu}, commit {report['commit']}, {report['date']}\n\n" + markdown(report)
    stem.with_suffix(".md").write_text(text)
    click.echo(text)


for _serving_command in COMMANDS:
    main.add_command(_serving_command)

if __name__ == "__main__":
    main()
