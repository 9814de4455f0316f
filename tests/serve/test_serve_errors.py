"""Bad input and faults on the real engine, with raw httpx: each case gets an OpenAI-shaped
error with the right status, and the server then is healthy and serves the next good request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_helpers import (
    ENGINE_CONFIG,
    FAULT_TRIGGER,
    MODEL,
    Server,
    faulty_engine,
    pool_state,
    real_engine,
    start_server,
    wait_until,
)

from ninfer_runtime.engine import EngineConfig
from ninfer_serve import ServeConfig

GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
VOCAB = 1152  # tiny profiles
MSG = [{"role": "user", "content": "hi"}]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_serves(s: Server, headers: dict | None = None) -> None:
    assert httpx.get(f"{s.url}/health").status_code == 200
    r = httpx.post(f"{s.api}/chat/completions", json=GOOD_CHAT, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


BAD_CHAT = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"max_completion_tokens": 100_000}, "max_tokens"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": 5}, None),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x " * 3000}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": "no user turn"}]}, "messages"),
]


@pytest.mark.parametrize("patch, param", BAD_CHAT, ids=[str(p)[:60] for p, _ in BAD_CHAT])
def test_bad_chat_request_is_a_400(server: Server, patch: dict, param: str | None) -> None:
    body = {**GOOD_CHAT, **patch}
    assert_error(httpx.post(f"{server.api}/chat/completions", json=body), 400, param)
    assert_serves(server)


BAD_COMPLETION = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": 3}, None),
    ({"logprobs": 21}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"max_tokens": 100_000}, "max_tokens"),
]


@pytest.mark.parametrize("patch, param", BAD_COMPLETION,
                         ids=[str(p)[:60] for p, _ in BAD_COMPLETION])
def test_bad_completion_request_is_a_400(server: Server, patch: dict,
                                         param: str | None) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4, **patch}
    assert_error(httpx.post(f"{server.api}/completions", json=body), 400, param)
    assert_serves(server)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""])
def test_malformed_body_is_a_400(server: Server, content: bytes) -> None:
    r = httpx.post(f"{server.api}/chat/completions", content=content,
                   headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_serves(server)


def test_unknown_model_route_and_method(server: Server) -> None:
    error = assert_error(httpx.post(f"{server.api}/chat/completions",
                                    json={**GOOD_CHAT, "model": "gpt-9"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(httpx.get(f"{server.api}/nothing-here"), 404)
    assert_error(httpx.get(f"{server.api}/chat/completions"), 405)
    assert_error(httpx.post(f"{server.url}/detokenize", json={"tokens": [VOCAB + 5]}), 400,
                 "tokens")
    assert_error(httpx.post(f"{server.url}/tokenize", json={}), 400, "prompt")
    assert_serves(server)


def test_queue_full_is_a_429(server: Server) -> None:
    body = {**GOOD_CHAT, "n": ENGINE_CONFIG.max_queue + 1}
    error = assert_error(httpx.post(f"{server.api}/chat/completions", json=body), 429)
    assert error["type"] == "rate_limit_error"
    assert_serves(server)


# ---- servers with their own settings ----

TIGHT = EngineConfig(max_context=2048, max_concurrency=1, max_queue=1, kv_capacity=1024,
                     device="cpu")
LONG = {**GOOD_CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def tight(artifact: Path) -> Iterator[Server]:
    """One request runs, one waits; the KV pool holds half a maximum context."""
    with start_server(real_engine(artifact, TIGHT), ServeConfig(MODEL, TIGHT)) as s:
        yield s


def test_a_full_waiting_queue_is_a_429(tight: Server) -> None:
    idle = tight.on_engine(pool_state)
    url = f"{tight.api}/chat/completions"
    with httpx.stream("POST", url, json=LONG) as running, httpx.stream("POST", url,
                                                                        json=LONG) as waiting:
        assert (running.status_code, waiting.status_code) == (200, 200)
        wait_until(lambda: tight.on_engine(pool_state).waiting == 1, "a queued request")
        error = assert_error(httpx.post(url, json=GOOD_CHAT), 429)
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
    # both clients left: their engine requests are aborted, the queue is empty again
    wait_until(lambda: tight.on_engine(pool_state) == idle, "pool back to idle")
    assert_serves(tight)


def test_a_request_larger_than_the_kv_pool_is_a_400(tight: Server) -> None:
    body = {**GOOD_CHAT, "max_tokens": 1500}  # within the context, beyond the KV pool
    error = assert_error(httpx.post(f"{tight.api}/chat/completions", json=body), 400)
    assert "KV pool" in error["message"]
    assert_serves(tight)


@pytest.fixture(scope="module")
def guarded(artifact: Path) -> Iterator[Server]:
    config = ServeConfig(MODEL, ENGINE_CONFIG, api_key="s3cret", max_body_bytes=64 * 1024)
    with start_server(real_engine(artifact), config) as s:
        yield s


KEY = {"Authorization": "Bearer s3cret"}


def test_api_key_is_required_except_for_health_and_metrics(guarded: Server) -> None:
    url = f"{guarded.api}/chat/completions"
    assert_error(httpx.post(url, json=GOOD_CHAT), 401)
    assert_error(httpx.post(url, json=GOOD_CHAT, headers={"Authorization": "Bearer nope"}), 401)
    assert_error(httpx.post(url, content=b"{bad", headers={"Authorization": "Basic s3cret"}),
                 401)
    assert_error(httpx.get(f"{guarded.api}/models"), 401)
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200
    assert_serves(guarded, KEY)


def test_oversized_body_is_a_413(guarded: Server) -> None:
    url = f"{guarded.api}/chat/completions"
    big = {**GOOD_CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
    assert_error(httpx.post(url, json=big, headers=KEY), 413)
    assert_serves(guarded, KEY)

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny-test", "messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}]}'

    assert_error(httpx.post(url, content=chunked(), headers={**KEY, "content-type":
                                                             "application/json"}), 413)
    assert_serves(guarded, KEY)


def test_health_is_503_while_the_model_loads(artifact: Path) -> None:
    release = threading.Event()
    load = real_engine(artifact)

    def slow_engine():
        release.wait(30)
        return load()

    with start_server(slow_engine, ServeConfig(MODEL, ENGINE_CONFIG), wait_ready=False) as s:
        assert_error(httpx.get(f"{s.url}/health"), 503)
        assert_error(httpx.post(f"{s.api}/chat/completions", json=GOOD_CHAT), 503)
        assert_error(httpx.post(f"{s.url}/tokenize", json={"prompt": "hi"}), 503)
        assert httpx.get(f"{s.api}/models").status_code == 200
        release.set()
        wait_until(lambda: httpx.get(f"{s.url}/health").status_code == 200, "model load")
        assert_serves(s)


def test_failed_load_reports_why() -> None:
    def broken():
        raise OSError("artifact is truncated")

    with start_server(broken, ServeConfig(MODEL, ENGINE_CONFIG), wait_ready=False) as s:
        wait_until(lambda: "truncated" in httpx.get(f"{s.url}/health").text, "load failure")
        assert_error(httpx.get(f"{s.url}/health"), 503)
        error = assert_error(httpx.post(f"{s.api}/chat/completions", json=GOOD_CHAT), 503)
        assert "truncated" in error["message"]


@pytest.fixture(scope="module")
def faulty(artifact: Path) -> Iterator[Server]:
    with start_server(faulty_engine(artifact), ServeConfig(MODEL, ENGINE_CONFIG)) as s:
        yield s


@pytest.mark.parametrize("stream", [False, True])
def test_engine_fault_fails_the_requests_not_the_server(faulty: Server, stream: bool) -> None:
    idle = faulty.on_engine(pool_state)
    body = {**GOOD_CHAT, "messages": [{"role": "user", "content": FAULT_TRIGGER}],
            "stream": stream}
    r = httpx.post(f"{faulty.api}/chat/completions", json=body)
    if stream:
        assert r.status_code == 200
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and "injected fault" in events[-2]
        assert events[-1] == "data: [DONE]"
    else:
        assert "injected fault" in assert_error(r, 500)["message"]
    assert faulty.on_engine(pool_state) == idle  # the faulted request's pages and slot are free
    assert_serves(faulty)
