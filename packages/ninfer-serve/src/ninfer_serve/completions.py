"""POST /v1/completions: raw text (or token ids) in, text out; no template, no parsing."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from ninfer_runtime.engine.request import TokenLogprob
from ninfer_serve.errors import APIError
from ninfer_serve.generation import Choice, Generation
from ninfer_serve.output import Delta, TextPipeline
from ninfer_serve.protocol import (
    CompletionRequest,
    defaults_from_generation_config,
    per_choice,
    sampling_params,
)
from ninfer_serve.serving import (
    cancel_on_disconnect,
    check_errors,
    check_model,
    completion_budget,
    hidden_ids,
    ready_engine,
    response_base,
    sse_stream,
    start_generation,
    stream_response,
)
from ninfer_serve.state import ServerState


@dataclass
class _ChoiceText:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0  # characters of token text so far (text_offset of the next token)


def _logprobs(tokenizer: Any, text: _ChoiceText, logprobs: tuple[TokenLogprob, ...],
              top: int) -> dict[str, Any]:
    """The legacy completions logprobs object for `logprobs`, continuing `text`'s offsets."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for lp in logprobs:
        token = tokenizer.decode([lp.token_id])
        out["tokens"].append(token)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({tokenizer.decode([t]): p for t, p in lp.top[:top]})
        out["text_offset"].append(text.offset)
        text.offset += len(token)
    return out


def _prompt_ids(tokenizer: Any, prompt: str | list[int], vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary "
                           f"(size {vocab_size})", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def _finish_reason(choice: Choice) -> str:
    return choice.finish_reason or "stop"


async def completion(req: CompletionRequest, state: ServerState, request: Request) -> Response:
    arrival = time.perf_counter()
    req.check()
    check_model(state, req.model)
    engine = ready_engine(state)
    tokenizer = engine.tokenizer
    vocab_size = engine.model_config.vocab_size
    prompt_ids = await asyncio.to_thread(_prompt_ids, tokenizer, req.single_prompt(), vocab_size)
    budget = completion_budget(state, len(prompt_ids), req.max_tokens, "prompt")
    params = sampling_params(req, defaults=defaults_from_generation_config(
        engine.generation_config), max_tokens=budget, vocab_size=vocab_size,
        logprobs=req.logprobs)
    hidden = hidden_ids(engine, req)
    pipelines = [TextPipeline(tokenizer, stop=req.stop_strings(), hidden_ids=hidden,
                              skip_special_tokens=req.skip_special_tokens)
                 for _ in range(req.n)]
    gen = await start_generation(state, prefix="cmpl", prompt_ids=prompt_ids,
                                 params=per_choice(params, req.n), pipelines=pipelines,
                                 arrival=arrival)
    texts = [_ChoiceText() for _ in range(req.n)]
    base = response_base(gen, state, "text_completion")
    top = req.logprobs or 0

    def logprobs(choice: Choice, new: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        if req.logprobs is None:
            return None
        return _logprobs(tokenizer, texts[choice.index], new, top)

    if req.stream:
        def render(choice: Choice, delta: Delta) -> dict[str, Any]:
            return {"index": choice.index, "text": delta.content,
                    "logprobs": logprobs(choice, delta.logprobs)}

        body = sse_stream(gen, base=base, options=req.stream_options, render=render,
                          finish_reason=_finish_reason)
        return stream_response(gen, body)

    await cancel_on_disconnect(request, _collect(gen, texts))
    choices = [{"index": c.index, "text": "".join(texts[c.index].text),
                "logprobs": logprobs(c, tuple(texts[c.index].logprobs)),
                "finish_reason": _finish_reason(c)} for c in gen.choices]
    return JSONResponse({**base, "choices": choices, "usage": gen.usage(),
                         "ninfer": gen.ninfer(choices[0]["finish_reason"])})


async def _collect(gen: Generation, texts: list[_ChoiceText]) -> None:
    try:
        async for choice, delta in gen.deltas():
            texts[choice.index].text.append(delta.content)
            texts[choice.index].logprobs.extend(delta.logprobs)
    finally:
        gen.close()
    check_errors(gen)
