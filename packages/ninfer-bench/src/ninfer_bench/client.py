"""The HTTP side: one persistent connection per client, chat requests timed from the client.

A `Client` is one worker's connection (the concurrency suites run exactly C of them). Without
streaming the client sees only the end-to-end latency; with `stream=True` it also times the
first token and the gaps between token-bearing chunks (vLLM's TTFT and ITL). Either way the
server's `ninfer` record (phase timings, counters) comes back with the reply when the server is
ninfer-serve. Errors never raise: they come back as a Reply with `error` set, so a run records
every request it sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

CONNECT_TIMEOUT_S = 30.0


class ClientError(RuntimeError):
    """A setup request (models, tokenize, intervals) that the server refused."""


@dataclass
class Reply:
    start: float  # time.time() when the request was sent
    e2el_s: float  # until the complete response was read
    status: int  # HTTP status; 0 for a transport error
    error: str | None = None
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: Mapping[str, Any] = field(default_factory=dict)
    ninfer: Mapping[str, Any] | None = None
    ttft_s: float | None = None  # streamed only
    itl_s: list[float] = field(default_factory=list)  # streamed only


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def _checked(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        raise ClientError(f"{response.request.method} {response.request.url.path}: HTTP "
                          f"{response.status_code}: {_error_message(response)}")
    return response


class Client:
    def __init__(self, url: str, *, stream: bool = False, timeout_s: float = 7200.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url
        self.stream = stream
        self._http = httpx.Client(base_url=url, transport=transport,
                                  timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def model(self) -> str:
        """The id of the served model."""
        return _checked(self._http.get("/v1/models")).json()["data"][0]["id"]

    def count_tokens(self, model: str, messages: Sequence[Mapping[str, Any]],
                     thinking: bool) -> int:
        """Tokens of the rendered chat prompt, by the server's tokenizer and template."""
        response = self._http.post("/tokenize", json={
            "model": model, "messages": list(messages),
            "chat_template_kwargs": {"enable_thinking": thinking}})
        return _checked(response).json()["count"]

    def intervals(self, since: float | None = None) -> list[dict[str, Any]] | None:
        """The server's one-second interval records (None if it has no such route)."""
        params = {} if since is None else {"since": since}
        response = self._http.get("/v1/ninfer/intervals", params=params)
        if response.status_code == 404:
            return None
        return _checked(response).json()["data"]

    def chat(self, body: Mapping[str, Any]) -> Reply:
        """POST /v1/chat/completions, streamed if this client streams."""
        start, t0 = time.time(), time.perf_counter()
        reply = Reply(start, 0.0, 0)
        try:
            if self.stream:
                self._streamed(body, reply, t0)
            else:
                self._whole(body, reply)
        except httpx.HTTPError as e:
            reply.error = f"{type(e).__name__}: {e}"
        reply.e2el_s = time.perf_counter() - t0
        return reply

    def _whole(self, body: Mapping[str, Any], reply: Reply) -> None:
        response = self._http.post("/v1/chat/completions", json={**body, "stream": False})
        reply.status = response.status_code
        if response.status_code != 200:
            reply.error = f"HTTP {response.status_code}: {_error_message(response)}"
            return
        data = response.json()
        choice = data["choices"][0]
        message = choice["message"]
        reply.content = message.get("content") or ""
        reply.reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        reply.finish_reason = choice.get("finish_reason")
        reply.usage = data.get("usage") or {}
        reply.ninfer = data.get("ninfer")

    def _streamed(self, body: Mapping[str, Any], reply: Reply, t0: float) -> None:
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        content, reasoning = [], []
        last = t0
        with self._http.stream("POST", "/v1/chat/completions", json=payload) as response:
            reply.status = response.status_code
            if response.status_code != 200:
                response.read()
                reply.error = f"HTTP {response.status_code}: {_error_message(response)}"
                return
            for line in response.iter_lines():
                data = line[len("data:"):].strip() if line.startswith("data:") else None
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    reply.error = f"stream error: {chunk['error'].get('message')}"
                    continue
                reply.usage = chunk.get("usage") or reply.usage
                reply.ninfer = chunk.get("ninfer") or reply.ninfer
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    if text or thought:
                        now = time.perf_counter()
                        if reply.ttft_s is None:
                            reply.ttft_s = now - t0
                        else:
                            reply.itl_s.append(now - last)
                        last = now
                        content.append(text)
                        reasoning.append(thought)
                    reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
        reply.content, reply.reasoning = "".join(content), "".join(reasoning)
