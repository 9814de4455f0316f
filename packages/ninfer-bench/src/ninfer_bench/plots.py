"""PNG plots of a run: tok/s against context length, aggregate tok/s against concurrency, and
decode tok/s per corpus fixture and category. One line (or bar group) per target.

matplotlib is a dependency of ninfer-bench, but a run must not fail for want of a plot: where it
cannot be imported, `plot` writes nothing and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Point = Mapping[str, Any]


def _lines(ax: Any, series: dict[str, list[tuple[float, float, float]]], xlabel: str,
           ylabel: str, log_x: bool = False) -> None:
    for name, xs in series.items():
        xs = sorted(xs)
        ax.errorbar([x for x, _, _ in xs], [y for _, y, _ in xs], yerr=[e for _, _, e in xs],
                    marker="o", capsize=3, label=name)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend()


def _context(plt: Any, points: Sequence[Point], path: Path) -> bool:
    points = [p for p in points if p["suite"] == "context"]
    if not points:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "prefill_tok_s", "Prefill tok/s"),
                           (axes[1], "decode_tok_s", "Decode tok/s")):
        series = {p["target"]: [(r["prompt_tokens"], r[key]["mean"], r[key]["std"] or 0.0)
                                for r in p["lengths"] if r[key] is not None]
                  for p in points}
        _lines(ax, series, "Prompt tokens", label, log_x=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _concurrency(plt: Any, points: Sequence[Point], path: Path) -> bool:
    kinds: list[tuple[str, str, Callable[[Point], float | None]]] = [
        ("corpus-makespan", "Decode tok/s over the makespan",
         lambda p: p["makespan"]["decode_tok_s"]),
        ("decode-saturation", "Steady aggregate decode tok/s",
         lambda p: p["saturation"].get("steady_decode_tok_s"))]
    kinds = [k for k in kinds if any(p["suite"] == k[0] for p in points)]
    if not kinds:
        return False
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
    for ax, (suite, label, value) in zip(axes[0], kinds, strict=True):
        series: dict[str, list[tuple[float, float, float]]] = {}
        for p in points:
            if p["suite"] == suite and value(p) is not None:
                series.setdefault(p["target"], []).append((p["concurrency"], value(p), 0.0))
        _lines(ax, series, "Concurrency C", label)
        ax.set_title(suite)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _corpus(plt: Any, points: Sequence[Point], path: Path) -> bool:
    points = [p for p in points if p["suite"] == "corpus"]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(points)
    labels: list[str] = []
    for i, p in enumerate(points):
        rows = [(r["fixture"], r["decode_tok_s"]) for r in p["fixtures"]]
        rows += [(r["category"], r["decode_tok_s"]) for r in p["categories"]]
        labels = labels or [name for name, _ in rows]
        ax.bar([j + i * width for j in range(len(rows))],
               [s["mean"] if s else 0.0 for _, s in rows], width,
               yerr=[(s["std"] or 0.0) if s else 0.0 for _, s in rows], capsize=3,
               label=p["target"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=20,
                  ha="right")
    ax.set_ylabel("Decode tok/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot(points: Sequence[Point], output: Path) -> list[str] | None:
    """Write the plots that `points` have data for; the file names written (None without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    written = []
    for name, fn in (("context_tok_s.png", _context), ("concurrency_tok_s.png", _concurrency),
                     ("corpus_decode_tok_s.png", _corpus)):
        if fn(plt, points, output / name):
            written.append(name)
    return written
