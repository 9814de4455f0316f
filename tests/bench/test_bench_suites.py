"""Each suite end to end with small flags: a real ninfer-serve (a subprocess, on the CPU) on the
embedded tiny artifact, and the files a run writes. The weights are random, so the tests check
structure and arithmetic, never answers or speed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from ninfer_bench.metrics import request_metrics, stat
from ninfer_bench.steady import steady

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def outputs(out: Path) -> tuple[list[dict], dict, str]:
    """(requests.jsonl records, summary.json, report.md) of a finished run."""
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return records, json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()


def assert_well_formed(records: list[dict], max_tokens: int) -> None:
    for r in records:
        assert r["error"] is None and r["status"] == 200
        assert 1 <= r["completion_tokens"] <= max_tokens and r["finish_reason"] in ("stop",
                                                                                   "length")
        assert r["metrics"] == request_metrics(r["ninfer"])  # recomputed from the raw record
        assert r["ninfer"]["prompt_tokens"] == r["prompt_tokens"]
        assert r["check"] is not None


def test_context(bench: Callable, serve: str, artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "context"
    result = bench("context", "--serve", serve, "--artifact", f"tiny={artifact}",
                   "--context-lengths", "256", "--seeds", "2", "--max-tokens", "4",
                   "--max-context", "512", "--output", out)
    assert result.exit_code == 0, result.output
    records, summary, report = outputs(out)
    assert [(r["fixture"], r["seed"]) for r in records] == [("niah_256", 101), ("niah_256", 202)]
    assert_well_formed(records, 4)
    [point] = summary["points"]
    [prompt] = point["prompts"]
    assert prompt["prompt_tokens"] == records[0]["prompt_tokens"] <= prompt["target_tokens"] == 240
    [row] = point["lengths"]
    assert row["samples"] == 2
    expected = stat(r["metrics"]["prefill_tok_s"] for r in records)
    assert row["prefill_tok_s"] == pytest.approx(expected.as_dict())
    assert "--max-concurrency 1" in point["command"] and "--prefill-chunk 1024" in point["command"]
    assert "random-init weights" in summary["meta"]["targets"][0]["description"]
    assert "| Prompt tokens | Samples | Prefill tok/s | Server TTFT (ms) | Decode tok/s |" in report
    assert "| niah_256 |" in report  # the audit
    assert (out / "context_tok_s.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "logs" / "context-tiny-c1.log").is_file()


def test_corpus(bench: Callable, serve: str, artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    result = bench("corpus", "--serve", serve, "--artifact", f"tiny={artifact}",
                   "--fixtures", "long_decode_math_01,translation_markdown_fr", "--seeds", "1",
                   "--max-tokens", "4", "--max-context", "2048", "--output", out)
    assert result.exit_code == 0, result.output
    records, summary, report = outputs(out)
    assert [r["fixture"] for r in records] == ["long_decode_math_01", "translation_markdown_fr"]
    assert [r["thinking"] for r in records] == [True, False]
    assert_well_formed(records, 4)
    [point] = summary["points"]
    assert [f["fixture"] for f in point["fixtures"]] == ["long_decode_math_01"]
    assert [c["category"] for c in point["categories"]] == ["translation"]
    assert {a["fixture"] for a in summary["audit"]} == {r["fixture"] for r in records}
    for title in ("Long-reasoning decode", "Cross-scenario decode", "## Output audit"):
        assert title in report
    assert (out / "corpus_decode_tok_s.png").read_bytes().startswith(PNG_MAGIC)


def test_corpus_makespan(bench: Callable, serve: str, artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "makespan"
    result = bench("concurrency", "--suite", "corpus-makespan", "--concurrency", "2",
                   "--serve", serve, "--artifact", f"tiny={artifact}", "--fixtures",
                   "code_c_ringbuf", "--seeds", "2", "--max-tokens", "3", "--max-context",
                   "1024", "--stream", "--output", out)
    assert result.exit_code == 0, result.output
    records, summary, report = outputs(out)
    assert sorted(r["index"] for r in records) == [0, 1]
    assert_well_formed(records, 3)
    assert all(r["client"]["ttft_s"] is not None for r in records)  # streamed
    [point] = summary["points"]
    m = point["makespan"]
    assert m["decode_tokens"] == sum(r["completion_tokens"] for r in records)
    assert m["computed_prefill_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert m["decode_tok_s"] == pytest.approx(m["decode_tokens"] / m["makespan_s"])
    assert sorted(point["send_order"]) == ["code_c_ringbuf#101", "code_c_ringbuf#202"]
    assert "--max-concurrency 2" in point["command"]
    assert point["vllm"]["completed"] == 2
    assert "| C | Requests | Computed prefill tokens | Decode tokens | Makespan (s) |" in report
    assert (out / "concurrency_tok_s.png").read_bytes().startswith(PNG_MAGIC)


def test_decode_saturation(bench: Callable, serve: str, artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "saturation"
    result = bench("concurrency", "--suite", "decode-saturation", "--concurrency", "2",
                   "--decode-tokens", "24", "--serve", serve, "--artifact", f"tiny={artifact}",
                   "--max-context", "512", "--output", out)
    assert result.exit_code == 0, result.output
    records, summary, report = outputs(out)
    assert sorted(r["seed"] for r in records) == [20260811, 20260812]
    assert_well_formed(records, 24)
    assert all(r["completion_tokens"] == 24 for r in records)  # ignore_eos: the full budget
    [point] = summary["points"]
    assert point["fixture"] == "long_decode_math_02" and point["decode_tokens"] == 24
    intervals = point["intervals"]
    assert intervals and sum(i["committed_decode_tokens"] for i in intervals) >= 48
    s = point["saturation"]
    assert s["steady_error"] is None and s["requests"] == 2 and s["completion_tokens"] == 48
    assert {k: s[k] for k in steady(intervals, 2).as_dict()} == steady(intervals, 2).as_dict()
    assert "## Decode saturation" in report
    assert "| Model profile | C | Steady (s) | Avg batch | Aggregate decode tok/s |" in report
