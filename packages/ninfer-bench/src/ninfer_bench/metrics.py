"""The seed's metrics, exactly as performance.md defines them, plus vLLM bench's summary keys.

Per request, from the server's unrounded phase timings and speculative counters (the `ninfer`
object of a response):

    prefill_tok_s         = prompt_tokens / prefill_seconds
    server_ttft_ms        = 1000 * (prepare_seconds + vision_seconds + prefill_seconds)
    decode_tok_s          = (completion_tokens - 1) / decode_seconds
    spec_acceptance       = accepted_tokens / drafted_tokens
    spec_tokens_per_round = 1 + accepted_tokens / speculative_rounds

A rate whose denominator is zero (no decode after the first token, no drafts) is None, not 0.
Aggregates are arithmetic mean and sample standard deviation (n - 1).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Record = Mapping[str, Any]  # one line of requests.jsonl (suites/common.py builds it)


@dataclass(frozen=True)
class Stat:
    mean: float
    std: float | None  # sample std; None for a single sample
    n: int

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "n": self.n}


def stat(values: Iterable[float | None]) -> Stat | None:
    """Mean and sample std of the values that are not None (None when there are none)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return Stat(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None, len(xs))


def metric_stat(records: Iterable[Record], name: str) -> dict[str, Any] | None:
    """stat() of the per-request metric `name` over `records`, as a dict."""
    s = stat(r["metrics"][name] for r in records)
    return None if s is None else s.as_dict()


def span_s(records: Sequence[Record]) -> float:
    """From the first request sent to the last response read (a serial run's duration)."""
    if not records:
        return 0.0
    return (max(r["client"]["start"] + r["client"]["e2el_s"] for r in records)
            - min(r["client"]["start"] for r in records))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def server_ttft_s(ninfer: Mapping[str, Any]) -> float:
    t = ninfer["timings"]
    return t["prepare_seconds"] + t["vision_seconds"] + t["prefill_seconds"]


def request_metrics(ninfer: Mapping[str, Any] | None) -> dict[str, float | None]:
    """The seed's five per-request metrics from a response's `ninfer` object (all None when
    the server reports none: a server other than ninfer-serve)."""
    if ninfer is None:
        return dict.fromkeys(("prefill_tok_s", "server_ttft_ms", "decode_tok_s",
                              "spec_acceptance", "spec_tokens_per_round"))
    t, spec = ninfer["timings"], ninfer["spec"]
    return {
        "prefill_tok_s": _ratio(ninfer["prompt_tokens"], t["prefill_seconds"]),
        "server_ttft_ms": 1000 * server_ttft_s(ninfer),
        "decode_tok_s": _ratio(ninfer["completion_tokens"] - 1, t["decode_seconds"]),
        "spec_acceptance": _ratio(spec["accepted_tokens"], spec["drafted_tokens"]),
        "spec_tokens_per_round": (1 + spec["accepted_tokens"] / spec["rounds"]
                                  if spec["rounds"] else None),
    }


def spec_acceptance(records: Iterable[Record]) -> float | None:
    """Accepted over drafted tokens summed over `records` (a whole wave or corpus)."""
    specs = [r["ninfer"]["spec"] for r in records if r.get("ninfer")]
    return _ratio(sum(s["accepted_tokens"] for s in specs),
                  sum(s["drafted_tokens"] for s in specs))


def ok(records: Iterable[Record]) -> list[Record]:
    """The records of requests that completed (no HTTP or transport error)."""
    return [r for r in records if r.get("error") is None]


def makespan_summary(records: Sequence[Record], makespan_s: float) -> dict[str, Any]:
    """The corpus-makespan row: token totals over the full makespan.

    Computed prefill tokens are the server's (the prompt tokens where it reports none). The
    average batch is the time requests spent in the running batch (server TTFT + decode time)
    summed over requests and divided by the makespan, so it covers the whole run: ramp-up,
    workload transitions and drain.
    """
    done = ok(records)
    prefill = sum(r["ninfer"]["computed_prefill_tokens"] if r.get("ninfer") else
                  r["prompt_tokens"] for r in done)
    decode = sum(r["completion_tokens"] for r in done)
    with_timings = [r["ninfer"] for r in done if r.get("ninfer")]
    in_batch = sum(server_ttft_s(n) + n["timings"]["decode_seconds"] for n in with_timings)
    return {
        "requests": len(records), "completed": len(done),
        "computed_prefill_tokens": prefill, "decode_tokens": decode,
        "makespan_s": makespan_s,
        "requests_per_s": _ratio(len(done), makespan_s),
        "prefill_tok_s": _ratio(prefill, makespan_s),
        "decode_tok_s": _ratio(decode, makespan_s),
        "avg_batch": _ratio(in_batch, makespan_s) if with_timings else None,
        "spec_acceptance": spec_acceptance(done),
    }


def _ttft_s(r: Record) -> float | None:
    """Client TTFT when streamed, else the server's arrival-to-first-token time."""
    if r["client"]["ttft_s"] is not None:
        return r["client"]["ttft_s"]
    if r.get("ninfer"):
        return r["ninfer"]["timings"]["queue_seconds"] + server_ttft_s(r["ninfer"])
    return None


def _tpot_s(r: Record) -> float | None:
    ttft = _ttft_s(r)
    if ttft is None or r["completion_tokens"] < 2:
        return None
    return (r["client"]["e2el_s"] - ttft) / (r["completion_tokens"] - 1)


def _distribution(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    ms = [v * 1000 for v in values_s]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else None,
        f"median_{name}_ms": statistics.median(ms) if ms else None,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else None,
        f"p99_{name}_ms": percentile(ms, 99) if ms else None,
    }


def vllm_summary(records: Sequence[Record], duration_s: float) -> dict[str, Any]:
    """`vllm bench serve`'s result keys over `records` (TPOT as vLLM defines it: (e2el - ttft)
    / (output tokens - 1); ITL only when the responses were streamed; std is vLLM's population
    std)."""
    done = ok(records)
    inputs = sum(r["prompt_tokens"] for r in done)
    outputs = sum(r["completion_tokens"] for r in done)
    out = {
        "completed": len(done), "failed": len(records) - len(done), "duration": duration_s,
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": _ratio(len(done), duration_s),
        "output_throughput": _ratio(outputs, duration_s),
        "total_token_throughput": _ratio(inputs + outputs, duration_s),
    }
    for name, values in (
        ("ttft", [v for r in done if (v := _ttft_s(r)) is not None]),
        ("tpot", [v for r in done if (v := _tpot_s(r)) is not None]),
        ("itl", [gap for r in done for gap in r["client"]["itl_s"]]),
        ("e2el", [r["client"]["e2el_s"] for r in done]),
    ):
        out |= _distribution(name, values)
    return out
