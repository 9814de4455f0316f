"""The steps chat and text completions share: checks, the token budget, submission, SSE."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ninfer_runtime.engine.request import SamplingParams
from ninfer_serve.client import Engine, EngineUnavailable
from ninfer_serve.errors import APIError, error_body
from ninfer_serve.generation import Choice, Generation
from ninfer_serve.output import Delta, TextPipeline
from ninfer_serve.protocol import SamplingRequest, StreamOptions
from ninfer_serve.state import ServerState

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


def ready_engine(state: ServerState) -> Engine:
    try:
        return state.client.ready_engine()
    except EngineUnavailable as e:
        raise APIError(503, str(e)) from e


def check_model(state: ServerState, model: str | None) -> None:
    name = state.config.served_model_name
    if model is not None and model != name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {name!r}",
                       param="model", code="model_not_found")


def completion_budget(state: ServerState, prompt_tokens: int, requested: int | None,
                      prompt_param: str) -> int:
    """max_tokens for the engine: what was asked, or all the room the context leaves."""
    max_context = state.config.engine.max_context
    if prompt_tokens >= max_context:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; the maximum context is "
                       f"{max_context} tokens", param=prompt_param,
                       code="context_length_exceeded")
    room = max_context - prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise APIError(400, f"the prompt ({prompt_tokens} tokens) plus max_tokens ({requested}) "
                       f"exceeds the maximum context of {max_context} tokens",
                       param="max_tokens", code="context_length_exceeded")
    return requested


def hidden_ids(engine: Engine, req: SamplingRequest) -> set[int]:
    """Token ids that end generation and never show in the text."""
    return set(engine.tokenizer.eos_token_ids) | set(req.stop_token_ids or ())


async def start_generation(state: ServerState, *, prefix: str, prompt_ids: Sequence[int],
                           params: Sequence[SamplingParams],
                           pipelines: Sequence[TextPipeline],
                           arrival: float) -> Generation:
    """Refuse when the queue is full (429), then submit the n engine requests."""
    load = state.client.load()
    max_queue = state.config.engine.max_queue
    if load.waiting + len(params) > max_queue:
        raise APIError(429, f"the server is busy ({load.waiting} requests waiting, limit "
                       f"{max_queue}); retry later", code="queue_full")
    gen = Generation(state.client, state.metrics, request_id=f"{prefix}-{uuid.uuid4().hex}",
                     prompt_ids=prompt_ids, params=params, pipelines=pipelines, arrival=arrival)
    await gen.start()
    return gen


def response_base(gen: Generation, state: ServerState, obj: str) -> dict[str, Any]:
    return {"id": gen.request_id, "object": obj, "created": int(time.time()),
            "model": state.config.served_model_name}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse_stream(gen: Generation, *, base: dict[str, Any], options: StreamOptions | None,
                     render: Callable[[Choice, Delta], dict[str, Any]],
                     finish_reason: Callable[[Choice], str],
                     opening: list[dict[str, Any]] | None = None) -> AsyncIterator[str]:
    """The SSE body: `opening` choices, then one chunk per non-empty delta, each choice's last
    chunk carrying its finish_reason, then usage and the `ninfer` record, then [DONE].

    With stream_options.include_usage they come in an extra chunk with no choices (OpenAI);
    without it they ride on the last choice chunk, so every stream ends with its statistics.
    """
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    try:
        if opening:
            yield sse({**base, "choices": opening})
        async for choice, delta in gen.deltas():
            if not delta and not choice.done:
                continue
            entry = render(choice, delta)
            entry["finish_reason"] = finish_reason(choice) if choice.done else None
            chunk: dict[str, Any] = {**base, "choices": [entry]}
            if continuous:
                chunk["usage"] = gen.usage()
            if all(c.done for c in gen.choices) and not include_usage and gen.error() is None:
                chunk["usage"] = gen.usage()
                chunk["ninfer"] = gen.ninfer(finish_reason(gen.choices[0]))
            yield sse(chunk)
        if (error := gen.error()) is not None:
            yield sse(error_body(500, error))
        elif include_usage:
            yield sse({**base, "choices": [], "usage": gen.usage(),
                       "ninfer": gen.ninfer(finish_reason(gen.choices[0]))})
        yield SSE_DONE
    finally:
        gen.close()


def stream_response(gen: Generation, body: AsyncIterator[str]) -> StreamingResponse:
    """An SSE response for `body`. `body` aborts unfinished choices when it ends or is cancelled;
    the background task covers a client that leaves before `body` ever started."""
    return StreamingResponse(body, media_type="text/event-stream",
                             background=BackgroundTask(gen.close))


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (a non-streaming request
    whose client gave up must not keep its slots). Starlette does this itself for streams."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise APIError(499, "client disconnected")
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


def check_errors(gen: Generation) -> None:
    if (error := gen.error()) is not None:
        raise APIError(500, error)
