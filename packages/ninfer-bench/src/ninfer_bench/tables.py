"""The Markdown report: the seed's tables (performance.md layouts, mean ± sample std) per point.

Speedups are against the C=1 point of the same target in the same run (a ratio measured in one
run is the figure that counts); a run without C=1 shows none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Point = Mapping[str, Any]


def num(x: float | None, decimals: int = 1) -> str:
    return "—" if x is None else f"{x:,.{decimals}f}"


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def mean_std(s: Mapping[str, Any] | None, decimals: int = 1, percent: bool = False) -> str:
    """"mean ± std" (the mean alone for a single sample, "—" for none)."""
    if s is None:
        return "—"
    fmt = pct if percent else (lambda x: num(x, decimals))
    return fmt(s["mean"]) if s["std"] is None else f"{fmt(s['mean'])} ± {fmt(s['std'])}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def spec_label(mode: str) -> str | None:
    """The speculative method's name in column titles (None without speculation)."""
    return {"mtp3": "MTP", "dflash7": "DFlash"}.get(mode)


def context_table(point: Point) -> str:
    rows = [[num(r["prompt_tokens"], 0), str(r["samples"]), mean_std(r["prefill_tok_s"]),
             mean_std(r["server_ttft_ms"]), mean_std(r["decode_tok_s"])]
            for r in point["lengths"]]
    return table(["Prompt tokens", "Samples", "Prefill tok/s", "Server TTFT (ms)",
                  "Decode tok/s"], rows)


def _decode_cells(row: Mapping[str, Any], spec: str | None) -> list[str]:
    cells = [mean_std(row["decode_tok_s"])]
    if spec:
        cells += [mean_std(row["spec_acceptance"], percent=True),
                  mean_std(row["spec_tokens_per_round"], 2)]
    return cells


def corpus_tables(point: Point, mode: str) -> str:
    spec = spec_label(mode)
    extra = [f"{spec} acceptance", f"{spec} tokens/round"] if spec else []
    out = []
    if point["fixtures"]:
        rows = [[r["fixture"], str(r["samples"]), mean_std(r["completion_tokens"]),
                 *_decode_cells(r, spec)] for r in point["fixtures"]]
        out.append("Long-reasoning decode\n\n" + table(
            ["Fixture", "Samples", "Completion tokens", "Decode tok/s", *extra], rows))
    if point["categories"]:
        rows = [[r["category"].capitalize(), str(r["samples"]), *_decode_cells(r, spec)]
                for r in point["categories"]]
        out.append("Cross-scenario decode\n\n" + table(
            ["Category", "Samples", "Decode tok/s", *extra], rows))
    return "\n".join(out)


def _speedup(points: Sequence[Point], point: Point, value: Any) -> str:
    base = next((p for p in points if p["target"] == point["target"]
                 and p["suite"] == point["suite"] and p["concurrency"] == 1), None)
    if base is None or value(base) in (None, 0) or value(point) is None:
        return "—"
    return f"{value(point) / value(base):.2f}×"


def makespan_table(points: Sequence[Point], mode: str) -> str:
    spec = spec_label(mode)
    rows = []
    for p in points:
        m = p["makespan"]
        rows.append([str(p["concurrency"]), str(m["requests"]),
                     num(m["computed_prefill_tokens"], 0), num(m["decode_tokens"], 0),
                     num(m["makespan_s"], 2), num(m["requests_per_s"], 4),
                     num(m["prefill_tok_s"]), num(m["decode_tok_s"]), num(m["avg_batch"], 2),
                     *([pct(m["spec_acceptance"])] if spec else []),
                     _speedup(points, p, lambda q: 1 / q["makespan"]["makespan_s"])])
    return table(["C", "Requests", "Computed prefill tokens", "Decode tokens", "Makespan (s)",
                  "Requests/s", "Prefill tok/s", "Decode tok/s", "Avg batch",
                  *([f"{spec} acceptance"] if spec else []), "Speedup vs. C1"], rows)


def saturation_table(points: Sequence[Point], mode: str) -> str:
    spec = spec_label(mode)
    rows = []
    for p in points:
        s = p["saturation"]
        rows.append([p["target"], str(p["concurrency"]), num(s.get("steady_s"), 2),
                     num(s.get("avg_batch"), 2), num(s.get("steady_decode_tok_s")),
                     *([pct(s["spec_acceptance"])] if spec else []),
                     _speedup(points, p, lambda q: q["saturation"].get("steady_decode_tok_s")),
                     num(s["wave_makespan_s"], 2)])
    return table(["Model profile", "C", "Steady (s)", "Avg batch", "Aggregate decode tok/s",
                  *([f"{spec} acceptance"] if spec else []), "Speedup vs. C1",
                  "Wave makespan (s)"], rows)


def vllm_table(points: Sequence[Point]) -> str:
    keys = ("ttft", "tpot", "itl", "e2el")
    rows = [[p["suite"], p["target"], str(p["concurrency"]), str(p["vllm"]["completed"]),
             *(f"{num(p['vllm'][f'mean_{k}_ms'])} / {num(p['vllm'][f'median_{k}_ms'])} / "
               f"{num(p['vllm'][f'p99_{k}_ms'])}" for k in keys)] for p in points]
    return table(["Suite", "Target", "C", "Completed",
                  *(f"{k.upper()} ms (mean / median / p99)" for k in keys)], rows)


def report(meta: Mapping[str, Any], points: Sequence[Point]) -> str:
    """The whole report.md."""
    mode = meta["mode"]
    out = [f"# ninfer-bench {meta['suite']}", "",
           f"GPU {meta['gpu']}, commit {meta['commit']}, {meta['date']}; mode {mode}, "
           f"sampling {meta['sampling']}, stream={str(meta['stream']).lower()}, "
           f"seeds {', '.join(map(str, meta['seeds']))}"
           + (f", output budgets capped at {meta['max_tokens']}" if meta["max_tokens"] else "")
           + ".", ""]
    for t in meta["targets"]:
        out.append(f"- {t['name']}: {t['description']}")
    out.append("")
    for target in dict.fromkeys(p["target"] for p in points):
        mine = [p for p in points if p["target"] == target]
        out += [f"## {target}", ""]
        for p in mine:
            if p["suite"] == "context":
                out += ["Context-length profile", "", context_table(p)]
            elif p["suite"] == "corpus":
                out += [corpus_tables(p, mode)]
        makespan = [p for p in mine if p["suite"] == "corpus-makespan"]
        if makespan:
            out += ["Concurrent corpus makespan", "", makespan_table(makespan, mode)]
            for p in makespan:
                out += [f"Per-fixture decode at C={p['concurrency']}", "",
                        corpus_tables(p, mode)]
    saturation = [p for p in points if p["suite"] == "decode-saturation"]
    if saturation:
        out += ["## Decode saturation", "", saturation_table(saturation, mode)]
        out += [f"- {p['target']} C={p['concurrency']}: {p['saturation']['steady_error']}"
                for p in saturation if p["saturation"]["steady_error"]]
        out.append("")
    out += ["## Client-side latency (vLLM bench keys)", "", vllm_table(points)]
    out += ["Server commands:", ""] + [f"- `{p['command']}`" for p in points if p["command"]]
    return "\n".join(out) + "\n"
