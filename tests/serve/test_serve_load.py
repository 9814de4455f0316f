"""The load test: 32 greedy requests sent at once through HTTP with the official openai client,
at --max-concurrency 4, all complete, and each gives exactly what it gives when the same requests
are sent one at a time to the same server (continuous batching and chunked prefill change no
token)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import MODEL, Server, pool_state, real_engine, start_server, wait_until

from ninfer_runtime.engine import EngineConfig
from ninfer_serve import ServeConfig

# Prompts longer than a prefill chunk are computed over several steps, interleaved with the
# decode steps of the requests already running.
LOAD = EngineConfig(max_context=512, max_concurrency=4, max_queue=32, prefill_chunk=16,
                    device="cpu")
WORDS = ("the", "sea", "is", "calm", "tonight", "and", "a", "small", "boat", "drifts", "under",
         "the", "pale", "moon")


def requests() -> list[dict]:
    """32 mixed requests: chat (thinking on and off) and text completions, prompts of 1 to
    ~50 tokens, 8 to 12 new tokens, greedy."""
    out = []
    for i in range(32):
        text = " ".join(WORDS[j % len(WORDS)] for j in range(i, i + 1 + (i * 7) % 32))
        common = {"model": MODEL, "max_tokens": 8 + i % 5, "temperature": 0.0}
        if i % 2:
            out.append({**common, "prompt": text})
        else:
            out.append({**common, "messages": [{"role": "user", "content": text}],
                        "extra_body": {"chat_template_kwargs": {"enable_thinking": i % 4 == 0}}})
    return out


def summary(response: object) -> tuple:
    """What must not change: the text, the finish reason, the token counts."""
    choice = response.choices[0]
    text = choice.text if hasattr(choice, "text") else (
        choice.message.content, choice.message.model_extra.get("reasoning_content"))
    return text, choice.finish_reason, response.usage.prompt_tokens, \
        response.usage.completion_tokens


async def send(api: openai.AsyncOpenAI, body: dict) -> object:
    if "prompt" in body:
        return await api.completions.create(**body)
    return await api.chat.completions.create(**body)


async def send_all(url: str, bodies: list[dict], concurrent: bool) -> list[tuple]:
    async with openai.AsyncOpenAI(api_key="unused", base_url=url, max_retries=0,
                                  timeout=120) as api:
        if concurrent:
            responses = await asyncio.gather(*(send(api, body) for body in bodies))
        else:
            responses = [await send(api, body) for body in bodies]
    return [summary(r) for r in responses]


@pytest.fixture(scope="module")
def loaded(artifact: Path) -> Iterator[Server]:
    with start_server(real_engine(artifact, LOAD), ServeConfig(MODEL, LOAD)) as s:
        yield s


def test_concurrent_requests_equal_sequential_ones(loaded: Server) -> None:
    bodies = requests()
    idle = loaded.on_engine(pool_state)
    start = math.floor(time.time())
    together = asyncio.run(send_all(loaded.api, bodies, concurrent=True))
    end = time.time()
    assert loaded.on_engine(pool_state) == idle  # every page and slot back
    alone = asyncio.run(send_all(loaded.api, bodies, concurrent=False))
    assert together == alone
    assert all(completion >= 1 for *_, completion in together)

    # the batch really was full: the interval records of the concurrent phase (complete once
    # their second is over) show 4 requests running at once, never more
    def records() -> list[dict]:
        data = httpx.get(f"{loaded.api}/ninfer/intervals", params={"since": start}).json()["data"]
        return [r for r in data if r["start"] <= end]

    wait_until(lambda: records() and records()[-1]["end"] > end, "the load's interval records")
    assert max(r["running"] for r in records()) == LOAD.max_concurrency
