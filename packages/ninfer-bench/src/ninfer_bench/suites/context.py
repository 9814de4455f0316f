"""`context`: Long NIAH prompts of ~8K to ~256K tokens, thinking off, 128 output tokens, five
seeds each, serially on one server per target: prefill tok/s, server TTFT and decode tok/s
against context length (the seed's MTP0 context-length profile)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ninfer_bench.fixtures import niah
from ninfer_bench.metrics import metric_stat, ok, span_s, stat, vllm_summary
from ninfer_bench.suites.common import Point, Run, fixture_jobs


def summarize(records: Sequence[dict[str, Any]],
              prompts: Sequence[niah.NiahPrompt]) -> list[dict[str, Any]]:
    """One row per context length: the seed's context-length table."""
    rows = []
    for prompt in prompts:
        mine = [r for r in records if r["fixture"] == prompt.fixture_id]
        done = ok(mine)
        tokens = stat(r["prompt_tokens"] for r in done)
        rows.append({
            "context_length": prompt.context_length, "target_tokens": prompt.target_tokens,
            "samples": len(done), "failed": len(mine) - len(done),
            "prompt_tokens": None if tokens is None else tokens.mean,
            "prefill_tok_s": metric_stat(done, "prefill_tok_s"),
            "server_ttft_ms": metric_stat(done, "server_ttft_ms"),
            "decode_tok_s": metric_stat(done, "decode_tok_s"),
            "needle_found": sum(1 for r in done if r["check"]["passed"]),
        })
    return rows


def run(run: Run, context_lengths: Sequence[int]) -> None:
    s = run.settings
    lengths = sorted(context_lengths)
    max_context = s.max_context or max(lengths)
    for target in s.targets:
        point = Point("context", target, 1, max_context)
        with run.endpoint(point) as endpoint, run.client(endpoint) as client:
            def count(text: str) -> int:
                return client.count_tokens(endpoint.model, [{"role": "user", "content": text}],
                                           thinking=False)

            built = [niah.build(length, count) for length in lengths]  # before measuring
            prompts = [prompt for prompt, _ in built]
            jobs = fixture_jobs([fixture for _, fixture in built], s)
            task = run.progress.add_task(f"{point.label} NIAH", total=len(jobs))
            records = [run.execute(client, endpoint, point, job, task) for job in jobs]
        run.writer.add_point({
            "suite": "context", "target": target.name, "concurrency": 1,
            "max_context": max_context, "command": endpoint.command,
            "prompts": [asdict(p) for p in prompts],
            "lengths": summarize(records, prompts),
            "vllm": vllm_summary(records, span_s(records))})
