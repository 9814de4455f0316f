"""The output audit: termination, output-limit hits, exact-line repetition loops, the fixtures'
mechanical checks and answer correctness, per target, concurrency and fixture.

Throughput is a transport/execution measurement; this audit says which samples were successful
completions. A request that exhausts its budget or loops stays a valid sustained-decode sample
but is not a completed task (performance.md, "Speculative-decode output audit").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ninfer_bench.fixtures import CROSS_CATEGORIES, REASONING

LOOP_MIN_CHARS = 8  # shorter lines ("}", "---", "end") repeat in healthy text
LOOP_MIN_COUNT = 8
LOOP_MIN_SHARE = 0.25  # of the non-empty lines
DETAIL_CHARS = 120


@dataclass(frozen=True)
class Loop:
    line: str
    count: int
    lines: int  # non-empty lines of the output


def repetition_loop(text: str) -> Loop | None:
    """The exact line that dominates `text`, if one does (a repetition loop)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    counts = Counter(line for line in lines if len(line) >= LOOP_MIN_CHARS)
    if not counts:
        return None
    line, count = counts.most_common(1)[0]
    if count >= LOOP_MIN_COUNT and count >= LOOP_MIN_SHARE * len(lines):
        return Loop(line, count, len(lines))
    return None


def _group(records: Sequence[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        key = (r["suite"], r["target"], r["concurrency"], r["category"], r["fixture"])
        groups.setdefault(key, []).append(r)
    return groups


def _fixture_audit(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in records if r["error"] is None]
    reasons = Counter(str(r["finish_reason"]) for r in done)
    checks = [r["check"] for r in done]
    loops = []
    for r in done:
        loop = repetition_loop(r["reasoning"] + "\n" + r["content"])
        if loop is not None:
            loops.append({"seed": r["seed"], **asdict(loop)})
    failures = Counter(c["detail"] for c in checks if not c["passed"])
    return {
        "samples": len(records), "errors": [r["error"] for r in records if r["error"]],
        "finish_reasons": dict(reasons),
        "natural_stops": reasons.get("stop", 0),
        "output_limit_hits": reasons.get("length", 0),
        "loops": loops,
        "passed": sum(1 for c in checks if c["passed"]),
        "answers": sum(1 for c in checks if c["answer"] is not None),
        "failures": dict(failures.most_common(3)),
    }


def audit(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (suite, target, concurrency, fixture)."""
    return [{"suite": s, "target": t, "concurrency": c, "category": cat, "fixture": f,
             **_fixture_audit(rs)} for (s, t, c, cat, f), rs in _group(records).items()]


def _answers(e: dict[str, Any]) -> str:
    wrong = e["answers"] - e["passed"]
    missing = e["samples"] - len(e["errors"]) - e["answers"]
    parts = [f"{e['passed']}/{e['samples']} correct"]
    parts += [f"{wrong} wrong"] if wrong else []
    parts += [f"{missing} no answer"] if missing else []
    parts += [f"{e['output_limit_hits']} reach the output limit"] if e["output_limit_hits"] else []
    parts += [f"{len(e['loops'])} repetition loops"] if e["loops"] else []
    return ", ".join(parts)


def _categories(entries: Sequence[dict[str, Any]]) -> list[str]:
    """The cross-scenario roll-up: natural stops and passed checks per category."""
    sums: dict[tuple, list[int]] = {}
    for e in entries:
        if e["category"] in CROSS_CATEGORIES:
            key = (e["suite"], e["target"], e["concurrency"], e["category"])
            acc = sums.setdefault(key, [0, 0, 0])
            acc[0] += e["samples"]
            acc[1] += e["natural_stops"]
            acc[2] += e["passed"]
    if not sums:
        return []
    lines = ["Cross-scenario outputs", "", "| Suite | Target | C | Category | Outputs |",
             "|---|---|---|---|---|"]
    lines += [f"| {s} | {t} | {c} | {cat.capitalize()} | {stops}/{n} natural stops; "
              f"{passed}/{n} pass the checks |"
              for (s, t, c, cat), (n, stops, passed) in sums.items()]
    return lines


def markdown(entries: Sequence[dict[str, Any]]) -> str:
    """The audit tables: every fixture's termination and checks, then the loops found."""
    lines = ["## Output audit", "",
             "| Suite | Target | C | Fixture | Samples | Natural stops | Output-limit hits | "
             "Loops | Checks passed | Result |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        if e["category"] == REASONING:
            result = _answers(e)
        elif e["category"] == "niah":
            result = f"needle found in {e['passed']}/{e['samples']}"
        else:
            result = "; ".join(d[:DETAIL_CHARS] for d in e["failures"]) or "all checks pass"
        other = {k: v for k, v in e["finish_reasons"].items() if k not in ("stop", "length")}
        if other:
            result += f"; other finish reasons {other}"
        if e["errors"]:
            result += f"; {len(e['errors'])} failed requests ({e['errors'][0]})"
        lines.append(f"| {e['suite']} | {e['target']} | {e['concurrency']} | {e['fixture']} | "
                     f"{e['samples']} | {e['natural_stops']} | {e['output_limit_hits']} | "
                     f"{len(e['loops'])} | {e['passed']}/{e['samples']} | "
                     f"{result.replace('|', '/')} |")
    lines += ["", *_categories(entries)]
    loops = [(e, loop) for e in entries for loop in e["loops"]]
    if loops:
        lines += ["", "Repetition loops (the exact line, its count among the non-empty lines):",
                  ""]
        lines += [f"- {e['target']} C={e['concurrency']} {e['fixture']} seed {loop['seed']}: "
                  f"`{loop['line'][:80]}` {loop['count']}/{loop['lines']}" for e, loop in loops]
    return "\n".join(lines) + "\n"
