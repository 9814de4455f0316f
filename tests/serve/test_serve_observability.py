"""Metrics, interval records, tokenizer routes, and slots released by clients that leave, on the
real engine."""

from __future__ import annotations

import math
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import ENGINE_CONFIG, MODEL, PoolState, Server, pool_state, wait_until

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "count for me"}]}


def scrape(s: Server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value}."""
    r = httpx.get(f"{s.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def metric(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_requests_tokens_and_latencies(server: Server) -> None:
    before = scrape(server)
    r = httpx.post(f"{server.api}/chat/completions",
                   json={**CHAT, "max_tokens": 5, "ignore_eos": True}).json()
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("ninfer:request_success_total", finished_reason="length") == 1
    assert delta("ninfer:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert delta("ninfer:generation_tokens_total") == 5
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):
        assert delta(f"ninfer:{histogram}_count") == 1, histogram
    assert delta("ninfer:request_generation_tokens_sum") == 5
    assert delta("ninfer:inter_token_latency_seconds_count") == 4
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert (f"ninfer:spec_decode_{name}_total", ()) in after
    assert metric(after, "ninfer:num_requests_running") == 0
    assert metric(after, "ninfer:num_requests_waiting") == 0


INTERVAL_KEYS = {"start", "end", "computed_prefill_tokens", "committed_decode_tokens", "running",
                 "prefilling", "decode_ready", "decode_rounds", "rows_per_round"}


def test_intervals_record_the_engine_work(server: Server) -> None:
    since = math.floor(time.time())
    r = httpx.post(f"{server.api}/completions", json={"model": MODEL, "prompt": "Once",
                                                      "max_tokens": 3, "ignore_eos": True})
    prompt_tokens = r.json()["usage"]["prompt_tokens"]

    def records() -> list[dict]:
        response = httpx.get(f"{server.api}/ninfer/intervals", params={"since": since})
        assert response.status_code == 200 and response.json()["object"] == "list"
        return response.json()["data"]

    # a record is returned once its second is over
    wait_until(lambda: sum(x["committed_decode_tokens"] for x in records()) >= 3,
               "the request's interval records")
    data = records()
    assert all(set(x) == INTERVAL_KEYS and x["end"] == x["start"] + 1 for x in data)
    assert all(x["start"] >= since for x in data)
    assert sum(x["computed_prefill_tokens"] for x in data) >= prompt_tokens
    assert max(x["running"] for x in data) >= 1
    assert all(x["decode_rounds"] == len(x["rows_per_round"]) for x in data)
    assert httpx.get(f"{server.api}/ninfer/intervals", params={"since": 1e12}).json() == {
        "object": "list", "data": []}
    bad = httpx.get(f"{server.api}/ninfer/intervals", params={"since": "yesterday"})
    assert bad.status_code == 400


def test_tokenize_and_detokenize_round_trip(server: Server) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world, again"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == ENGINE_CONFIG.max_context
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text == "Hello world, again"
    chat = httpx.post(f"{server.api}/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT["messages"]}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"]


def _aborted(s: Server) -> float:
    return metric(scrape(s), "ninfer:request_success_total", finished_reason="abort")


def _released(s: Server, idle: PoolState, aborted: float) -> None:
    """The request was aborted, and the engine holds nothing for it any more: no running
    request, every KV page and state slot free again."""
    wait_until(lambda: _aborted(s) == aborted + 1, "abort of the left request")
    wait_until(lambda: s.on_engine(pool_state) == idle, "pages and slot freed")
    assert metric(scrape(s), "ninfer:num_requests_running") == 0


def test_stream_disconnect_releases_the_slot_and_memory(server: Server) -> None:
    idle, aborted = server.on_engine(pool_state), _aborted(server)
    assert idle.running == 0 and idle.free_pages > 0
    body = {**CHAT, "stream": True, "ignore_eos": True, "max_tokens": 1900}
    with httpx.stream("POST", f"{server.api}/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        held = server.on_engine(pool_state)
        assert held.running == 1 and held.free_pages < idle.free_pages
        assert held.free_slots == idle.free_slots - 1
    # the connection is closed here, long before 1900 tokens
    _released(server, idle, aborted)


def test_non_stream_disconnect_releases_the_slot_and_memory(server: Server) -> None:
    idle, aborted = server.on_engine(pool_state), _aborted(server)
    body = {**CHAT, "ignore_eos": True, "max_tokens": 1900}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.api}/chat/completions", json=body, timeout=0.3)
    _released(server, idle, aborted)
