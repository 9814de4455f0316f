"""POST /v1/chat/completions: template, reasoning split, tool calls, streaming or not."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from ninfer_runtime.engine.request import TokenLogprob
from ninfer_runtime.tokenizer import ChatTemplateError
from ninfer_serve.errors import APIError
from ninfer_serve.generation import Choice, Generation
from ninfer_serve.output import Delta, TextPipeline
from ninfer_serve.protocol import (
    ChatRequest,
    defaults_from_generation_config,
    per_choice,
    sampling_params,
)
from ninfer_serve.reasoning import start_mode
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


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, kwargs: dict[str, Any],
                  add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """The rendered prompt and its ids; a conversation the template rejects is a 400."""
    kwargs = dict(kwargs)
    enable_thinking = kwargs.pop("enable_thinking", True)
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=tools,
                                               add_generation_prompt=add_generation_prompt,
                                               enable_thinking=enable_thinking, **kwargs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from e
    return prompt, tokenizer.encode(prompt)


@dataclass
class _ChoiceText:
    """What one choice said so far; numbers its tool calls with OpenAI ids."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, delta: Delta) -> list[dict[str, Any]]:
        """Record `delta`; return its tool-call entries in streaming (delta) form."""
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        self.logprobs.extend(delta.logprobs)
        entries: dict[int, dict[str, Any]] = {}
        for d in delta.tool_calls:
            call = self.calls.get(d.index)
            entry = entries.get(d.index)
            if call is None:
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": d.name or "", "arguments": ""}}
                self.calls[d.index] = call
                entry = {"index": d.index, "id": call["id"], "type": "function",
                         "function": {"name": call["function"]["name"], "arguments": ""}}
            elif entry is None:
                entry = {"index": d.index, "function": {"arguments": ""}}
            entries[d.index] = entry
            call["function"]["arguments"] += d.arguments
            entry["function"]["arguments"] += d.arguments
        return list(entries.values())

    def message(self) -> dict[str, Any]:
        content = "".join(self.content)
        reasoning = "".join(self.reasoning) or None
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not self.calls else None,
            "reasoning_content": reasoning,
            "reasoning": reasoning,
        }
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return message


def _finish_reason(choice: Choice, text: _ChoiceText) -> str:
    if choice.finish_reason == "stop" and text.calls:
        return "tool_calls"
    return choice.finish_reason or "stop"


def _logprobs(tokenizer: Any, logprobs: list[TokenLogprob], top: int) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, p) for t, p in lp.top[:top]]}
                        for lp in logprobs]}


async def chat_completion(req: ChatRequest, state: ServerState, request: Request) -> Response:
    arrival = time.perf_counter()
    req.check()
    check_model(state, req.model)
    engine = ready_engine(state)
    tokenizer = engine.tokenizer
    messages = [m.for_template(i) for i, m in enumerate(req.messages)]
    tools = req.tool_dicts()
    prompt, prompt_ids = await asyncio.to_thread(render_prompt, tokenizer, messages, tools,
                                                 req.template_kwargs())
    budget = completion_budget(state, len(prompt_ids), req.token_budget(), "messages")
    top = req.top_logprobs or 0
    params = sampling_params(req, defaults=defaults_from_generation_config(
        engine.generation_config), max_tokens=budget, vocab_size=engine.model_config.vocab_size,
        logprobs=top if req.logprobs else None)
    mode = start_mode(prompt)
    hidden = hidden_ids(engine, req)
    pipelines = [TextPipeline(tokenizer, stop=req.stop_strings(), hidden_ids=hidden,
                              reasoning=mode, tools=tools,
                              skip_special_tokens=req.skip_special_tokens)
                 for _ in range(req.n)]
    gen = await start_generation(state, prefix="chatcmpl", prompt_ids=prompt_ids,
                                 params=per_choice(params, req.n), pipelines=pipelines,
                                 arrival=arrival)
    texts = [_ChoiceText() for _ in range(req.n)]
    base = response_base(gen, state, "chat.completion")

    if req.stream:
        def render(choice: Choice, delta: Delta) -> dict[str, Any]:
            calls = texts[choice.index].add(delta)
            out: dict[str, Any] = {}
            if delta.content:
                out["content"] = delta.content
            if delta.reasoning:
                out["reasoning_content"] = out["reasoning"] = delta.reasoning
            if calls:
                out["tool_calls"] = calls
            logprobs = _logprobs(tokenizer, list(delta.logprobs), top) if req.logprobs else None
            return {"index": choice.index, "delta": out, "logprobs": logprobs}

        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(req.n)]
        body = sse_stream(gen, base={**base, "object": "chat.completion.chunk"},
                          options=req.stream_options, render=render, opening=opening,
                          finish_reason=lambda c: _finish_reason(c, texts[c.index]))
        return stream_response(gen, body)

    await cancel_on_disconnect(request, _collect(gen, texts))
    choices = [{"index": c.index, "message": texts[c.index].message(),
                "logprobs": _logprobs(tokenizer, texts[c.index].logprobs, top)
                if req.logprobs else None,
                "finish_reason": _finish_reason(c, texts[c.index])} for c in gen.choices]
    return JSONResponse({**base, "choices": choices, "usage": gen.usage(),
                         "ninfer": gen.ninfer(choices[0]["finish_reason"])})


async def _collect(gen: Generation, texts: list[_ChoiceText]) -> None:
    try:
        async for choice, delta in gen.deltas():
            texts[choice.index].add(delta)
    finally:
        gen.close()
    check_errors(gen)
