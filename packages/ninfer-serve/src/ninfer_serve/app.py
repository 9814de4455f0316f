"""The FastAPI app: OpenAI routes, tokenizer routes, health, metrics and interval records.

`create_app` takes an engine factory rather than an engine: the factory runs on the engine
thread when the app starts, so the server listens (and /health answers 503) while the model loads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ninfer_serve.chat import chat_completion, render_prompt
from ninfer_serve.client import Engine, EngineClient
from ninfer_serve.completions import completion
from ninfer_serve.config import ServeConfig
from ninfer_serve.errors import APIError, error_response, install_error_handlers
from ninfer_serve.metrics import Metrics
from ninfer_serve.middleware import APIKeyMiddleware, BodyLimitMiddleware
from ninfer_serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from ninfer_serve.serving import check_model, ready_engine
from ninfer_serve.state import ServerState, State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> Response:
    client = state.client
    if client.state == "ready":
        return Response(status_code=200)
    if client.state == "failed":
        return error_response(503, f"the model failed to load: {client.error}")
    return error_response(503, f"the model is {client.state}")


@router.get("/metrics")
async def metrics(state: State) -> Response:
    load = state.client.load()
    state.metrics.set_load(load.running, load.waiting)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(state: State) -> dict:
    return {"object": "list", "data": [{
        "id": state.config.served_model_name, "object": "model",
        "created": state.created, "owned_by": "ninfer",
        "max_model_len": state.config.engine.max_context}]}


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request,
               state: State) -> Response:
    return await chat_completion(body, state, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request,
                      state: State) -> Response:
    return await completion(body, state, request)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> dict:
    check_model(state, body.model)
    tokenizer = ready_engine(state).tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        _, ids = await asyncio.to_thread(render_prompt, tokenizer, messages, tools,
                                         body.chat_template_kwargs or {},
                                         body.add_generation_prompt)
    else:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.config.engine.max_context, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest,
                     state: State) -> dict:
    check_model(state, body.model)
    tokenizer = ready_engine(state).tokenizer
    bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (size "
                       f"{tokenizer.vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


@router.get("/v1/ninfer/intervals")
async def intervals(state: State, since: float | None = None) -> dict:
    """The engine's one-second records (ninfer-bench reads steady-state decode from them)."""
    ready_engine(state)
    records = await state.client.call(lambda engine: engine.intervals(since))
    return {"object": "list", "data": records}


def create_app(config: ServeConfig, engine_factory: Callable[[], Engine], *,
               on_load_error: Callable[[BaseException], Any] | None = None,
               on_ready: Callable[[], Any] | None = None) -> FastAPI:
    """The server app. The engine is built by `engine_factory` on the engine thread at startup;
    `on_ready` is called there once it is built, `on_load_error` if that fails (the CLI uses them
    to announce itself and to exit)."""
    client = EngineClient(engine_factory, on_load_error, on_ready)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            yield
        finally:
            client.stop()

    app = FastAPI(title="ninfer-serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ninfer = ServerState(config, client, Metrics(config.served_model_name),
                                   created=int(time.time()))
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)  # outermost: first
    return app
