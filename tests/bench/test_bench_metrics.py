"""The seed's metric arithmetic against hand-computed values, from recorded server responses:
per request, vLLM's summary keys, the corpus makespan row, and response parsing (whole and
streamed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from ninfer_bench.client import Client, Reply
from ninfer_bench.fixtures import Fixture
from ninfer_bench.metrics import (
    makespan_summary,
    percentile,
    request_metrics,
    stat,
    vllm_summary,
)
from ninfer_bench.settings import Settings, Target
from ninfer_bench.suites.common import Job, Point, make_record

# Two recorded ninfer-serve responses (stream=false): an MTP0 NIAH request and an MTP3 one.
CONTEXT_RESPONSE = json.loads("""{
 "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
 "choices": [{"index": 0, "finish_reason": "length",
              "message": {"role": "assistant", "content": "amber-falcon-00042",
                          "reasoning_content": null}}],
 "usage": {"prompt_tokens": 7680, "completion_tokens": 128, "total_tokens": 7808},
 "ninfer": {"prompt_tokens": 7680, "computed_prefill_tokens": 7680, "cached_prompt_tokens": 0,
            "completion_tokens": 128, "finish_reason": "length",
            "timings": {"queue_seconds": 0.004, "prepare_seconds": 0.002,
                        "vision_seconds": 0.001, "prefill_seconds": 0.5,
                        "decode_seconds": 1.27},
            "spec": {"drafted_tokens": 0, "accepted_tokens": 0, "rounds": 0,
                     "accepted_per_position": []}}}""")
MTP3_RESPONSE = json.loads("""{
 "id": "chatcmpl-2", "object": "chat.completion", "model": "m",
 "choices": [{"index": 0, "finish_reason": "stop",
              "message": {"role": "assistant", "content": "so \\\\boxed{131}",
                          "reasoning_content": "think"}}],
 "usage": {"prompt_tokens": 300, "completion_tokens": 1001, "total_tokens": 1301},
 "ninfer": {"prompt_tokens": 300, "computed_prefill_tokens": 300, "cached_prompt_tokens": 0,
            "completion_tokens": 1001, "finish_reason": "stop",
            "timings": {"queue_seconds": 0.0, "prepare_seconds": 0.01, "vision_seconds": 0.0,
                        "prefill_seconds": 0.09, "decode_seconds": 4.0},
            "spec": {"drafted_tokens": 900, "accepted_tokens": 600, "rounds": 300,
                     "accepted_per_position": [250, 200, 150]}}}""")

SETTINGS = Settings(serve=("ninfer-serve",), targets=(Target("m", Path("m.ninfer")),), url=None,
                    mode="mtp3", sampling="stochastic", max_context=None, kv_capacity="auto",
                    output=Path("out"), fixtures=(), seeds=(101,), max_tokens=None, stream=False,
                    startup_timeout_s=1.0, request_timeout_s=1.0)
POINT = Point("corpus", SETTINGS.targets[0], 1, 131072)
FIXTURE = Fixture("long_decode_math_01", "reasoning", "p", True, 65536,
                  {"kind": "boxed_answer", "answer": "131"})


def record(response: dict, e2el_s: float, *, error: str | None = None,
           ttft_s: float | None = None, itl_s: tuple[float, ...] = ()) -> dict:
    """The requests.jsonl line the bench writes for `response` (as Client would parse it)."""
    choice = response["choices"][0]
    reply = Reply(start=1000.0, e2el_s=e2el_s, status=200, error=error,
                  content=choice["message"]["content"],
                  reasoning=choice["message"]["reasoning_content"] or "",
                  finish_reason=choice["finish_reason"], usage=response["usage"],
                  ninfer=response["ninfer"], ttft_s=ttft_s, itl_s=list(itl_s))
    return make_record(POINT, Job(0, FIXTURE, 101), reply, SETTINGS)


def test_per_request_metrics_match_the_seed_formulas() -> None:
    m = request_metrics(CONTEXT_RESPONSE["ninfer"])
    assert m["prefill_tok_s"] == pytest.approx(7680 / 0.5)  # 15,360
    assert m["server_ttft_ms"] == pytest.approx(1000 * (0.002 + 0.001 + 0.5))  # 503 ms
    assert m["decode_tok_s"] == pytest.approx(127 / 1.27)  # 100 tok/s
    assert m["spec_acceptance"] is None and m["spec_tokens_per_round"] is None  # no drafts
    m = request_metrics(MTP3_RESPONSE["ninfer"])
    assert m["prefill_tok_s"] == pytest.approx(300 / 0.09)
    assert m["server_ttft_ms"] == pytest.approx(100.0)
    assert m["decode_tok_s"] == pytest.approx(250.0)
    assert m["spec_acceptance"] == pytest.approx(600 / 900)
    assert m["spec_tokens_per_round"] == pytest.approx(3.0)


def test_a_single_token_has_no_decode_rate_and_other_servers_no_metrics() -> None:
    one = json.loads(json.dumps(CONTEXT_RESPONSE["ninfer"]))
    one["completion_tokens"], one["timings"]["decode_seconds"] = 1, 0.0
    assert request_metrics(one)["decode_tok_s"] is None
    assert set(request_metrics(None).values()) == {None}


def test_the_record_carries_metrics_and_the_fixture_check() -> None:
    r = record(MTP3_RESPONSE, 4.2)
    assert r["check"] == {"passed": True, "detail": "correct", "answer": "131"}
    assert (r["prompt_tokens"], r["completion_tokens"], r["finish_reason"]) == (300, 1001, "stop")
    assert r["metrics"]["decode_tok_s"] == pytest.approx(250.0)
    assert record(MTP3_RESPONSE, 4.2, error="HTTP 500: boom")["check"] is None


def test_mean_and_sample_std() -> None:
    s = stat([1.0, 2.0, None, 3.0, 4.0])
    assert (s.mean, s.n) == (2.5, 4)
    assert s.std == pytest.approx(math.sqrt(5 / 3))  # n - 1 in the denominator
    assert stat([7.0]).std is None
    assert stat([None]) is None


def test_percentile_interpolates_linearly() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile([3.0], 99) == 3.0


def test_vllm_keys_by_hand() -> None:
    a, b = record(CONTEXT_RESPONSE, 1.8), record(MTP3_RESPONSE, 4.2)
    failed = record(MTP3_RESPONSE, 0.1, error="HTTP 500: boom")
    out = vllm_summary([a, b, failed], duration_s=10.0)
    assert (out["completed"], out["failed"]) == (2, 1)
    assert (out["total_input_tokens"], out["total_output_tokens"]) == (7980, 1129)
    assert out["request_throughput"] == pytest.approx(0.2)
    assert out["output_throughput"] == pytest.approx(112.9)
    assert out["total_token_throughput"] == pytest.approx(910.9)
    # not streamed: TTFT is the server's arrival-to-first-token (queue + the seed's TTFT)
    assert out["mean_ttft_ms"] == pytest.approx((507 + 100) / 2)
    assert out["p99_ttft_ms"] == pytest.approx(100 + 407 * 0.99)
    tpot_a, tpot_b = (1.8 - 0.507) / 127 * 1000, (4.2 - 0.1) / 1000 * 1000
    assert out["mean_tpot_ms"] == pytest.approx((tpot_a + tpot_b) / 2)
    assert out["median_e2el_ms"] == pytest.approx(3000.0)
    assert out["std_e2el_ms"] == pytest.approx(1200.0)  # vLLM's population std
    assert out["mean_itl_ms"] is None  # nothing streamed


def test_streamed_records_use_client_ttft_and_itl() -> None:
    c = record(MTP3_RESPONSE, 4.2, ttft_s=0.2, itl_s=(0.01, 0.03))
    out = vllm_summary([c], duration_s=4.2)
    assert out["mean_ttft_ms"] == pytest.approx(200.0)
    assert out["mean_itl_ms"] == pytest.approx(20.0)
    assert out["p99_itl_ms"] == pytest.approx(10 + 20 * 0.99)
    assert out["mean_tpot_ms"] == pytest.approx((4.2 - 0.2) / 1000 * 1000)


def test_corpus_makespan_row_by_hand() -> None:
    rows = [record(CONTEXT_RESPONSE, 1.8), record(MTP3_RESPONSE, 4.2),
            record(MTP3_RESPONSE, 0.1, error="HTTP 500: boom")]
    m = makespan_summary(rows, 10.0)
    assert (m["requests"], m["completed"]) == (3, 2)
    assert (m["computed_prefill_tokens"], m["decode_tokens"]) == (7980, 1129)
    assert m["requests_per_s"] == pytest.approx(0.2)
    assert m["prefill_tok_s"] == pytest.approx(798.0)
    assert m["decode_tok_s"] == pytest.approx(112.9)
    # time in the running batch: server TTFT + decode, summed, over the makespan
    assert m["avg_batch"] == pytest.approx((0.503 + 1.27 + 0.1 + 4.0) / 10)
    assert m["spec_acceptance"] == pytest.approx(600 / 900)


def _client(handler) -> Client:
    return Client("http://test", transport=httpx.MockTransport(handler))


def test_client_parses_a_whole_response_and_errors() -> None:
    reply = _client(lambda _: httpx.Response(200, json=MTP3_RESPONSE)).chat({"model": "m"})
    assert (reply.status, reply.error, reply.content, reply.reasoning) == (
        200, None, "so \\boxed{131}", "think")
    assert reply.ninfer == MTP3_RESPONSE["ninfer"] and reply.ttft_s is None
    bad = _client(lambda _: httpx.Response(
        429, json={"error": {"message": "the server is busy"}})).chat({"model": "m"})
    assert (bad.status, bad.error) == (429, "HTTP 429: the server is busy")


def test_client_parses_a_stream() -> None:
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "hm",
                                                  "reasoning": "hm"}}]},
              {"choices": [{"index": 0, "delta": {"content": "so "}}]},
              {"choices": [{"index": 0, "delta": {"content": "\\boxed{131}"},
                            "finish_reason": "stop"}]},
              {"choices": [], "usage": MTP3_RESPONSE["usage"],
               "ninfer": MTP3_RESPONSE["ninfer"]}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    reply = _client(handler)
    reply.stream = True
    got = reply.chat({"model": "m"})
    assert seen[0]["stream"] is True and seen[0]["stream_options"] == {"include_usage": True}
    assert (got.content, got.reasoning, got.finish_reason) == ("so \\boxed{131}", "hm", "stop")
    assert got.ninfer == MTP3_RESPONSE["ninfer"] and got.usage == MTP3_RESPONSE["usage"]
    assert got.ttft_s is not None and len(got.itl_s) == 2  # three token-bearing chunks
