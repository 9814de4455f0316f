"""End to end with the official `openai` client against a real uvicorn server.

Tests on `server` run the real engine on the random-weight default model, so they assert what
holds for any text (greedy determinism, counts, finish reasons, timings); tests on `scripted`
rely on FakeEngine's known replies (reasoning, tool calls, stop tokens).
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from fake_engine import REASONING
from serve_helpers import MODEL, Server

USER = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0.0}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}


def client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=s.api, max_retries=0)


def stream_text(chunks: list) -> tuple[str, str]:
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    return content, reasoning


def prompt_tokens(s: Server, messages: list[dict], **kwargs: object) -> int:
    r = httpx.post(f"{s.url}/tokenize", json={"messages": messages, **kwargs})
    assert r.status_code == 200, r.text
    return r.json()["count"]


# ---- the real engine ----

def test_models_lists_the_served_model(server: Server) -> None:
    models = client(server).models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_reports_usage_and_ninfer_record(server: Server) -> None:
    start = time.perf_counter()
    r = client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=16,
                                               extra_body={"ignore_eos": True}, **GREEDY)
    elapsed = time.perf_counter() - start
    assert r.object == "chat.completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == prompt_tokens(server, USER)
    assert r.usage.completion_tokens == 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    record = r.model_extra["ninfer"]
    assert record["prompt_tokens"] == r.usage.prompt_tokens
    assert record["completion_tokens"] == r.usage.completion_tokens
    assert record["finish_reason"] == r.choices[0].finish_reason
    timings = record["timings"]
    assert set(timings) == {"queue_seconds", "prepare_seconds", "vision_seconds",
                            "prefill_seconds", "decode_seconds"}
    # the engine's phase times, measured: the prompt and 15 decode steps took time; queue,
    # prefill (which includes preparing the first step) and decode follow one another inside
    # what the client waited
    assert timings["prefill_seconds"] > 0 and timings["decode_seconds"] > 0
    assert 0 <= timings["prepare_seconds"] <= timings["prefill_seconds"]
    assert timings["queue_seconds"] >= 0 and timings["vision_seconds"] == 0
    assert timings["queue_seconds"] + timings["prefill_seconds"] + timings["decode_seconds"] \
        <= elapsed
    assert record["spec"] == {"drafted_tokens": 0, "accepted_tokens": 0, "rounds": 0,
                              "accepted_per_position": []}
    assert record["computed_prefill_tokens"] + record["cached_prompt_tokens"] == \
        r.usage.prompt_tokens


def test_chat_stream_matches_the_non_streamed_reply(server: Server) -> None:
    c = client(server)
    whole = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=24, **GREEDY)
    chunks = list(c.chat.completions.create(model=MODEL, messages=USER, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    content, reasoning = stream_text(chunks)
    message = whole.choices[0].message
    assert content == (message.content or "")
    assert reasoning == (message.model_extra.get("reasoning_content") or "")
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage == whole.usage
    assert last.model_extra["ninfer"]["completion_tokens"] == whole.usage.completion_tokens


def test_stream_without_include_usage_still_ends_with_usage(server: Server) -> None:
    chunks = list(client(server).chat.completions.create(model=MODEL, messages=USER,
                                                         max_tokens=8, stream=True, **GREEDY))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason is not None
    assert chunks[-1].usage.completion_tokens >= 1
    assert "ninfer" in chunks[-1].model_extra


def test_completion_respects_max_tokens_and_streams_the_same_text(server: Server) -> None:
    c = client(server)
    extra = {"ignore_eos": True}
    whole = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                 extra_body=extra, **GREEDY)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    chunks = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                       stream=True, extra_body=extra, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text_before_it(server: Server, stream: bool) -> None:
    c = client(server)
    text = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
    assert len(text) >= 8
    stop = text[4:7]
    expected = text[:text.find(stop)]
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "stop": [stop],
              "extra_body": {"ignore_eos": True}, **GREEDY}
    if stream:
        chunks = list(c.completions.create(stream=True, **kwargs))
        got = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    else:
        r = c.completions.create(**kwargs)
        got, finish = r.choices[0].text, r.choices[0].finish_reason
    assert (got, finish) == (expected, "stop")


def test_n_choices_with_a_seed(server: Server) -> None:
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}

    def sample() -> openai.types.chat.ChatCompletion:
        return client(server).chat.completions.create(
            model=MODEL, messages=USER, n=3, seed=7, max_tokens=8, temperature=0.8,
            extra_body={"ignore_eos": True, **no_thinking})

    r = sample()
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == prompt_tokens(server, USER, **no_thinking)
    assert r.usage.completion_tokens == 3 * 8
    assert r.model_extra["ninfer"]["completion_tokens"] == r.usage.completion_tokens
    texts = [ch.message.content for ch in r.choices]
    assert len(set(texts)) > 1  # each choice has its own seed (seed + index)
    assert [ch.message.content for ch in sample().choices] == texts  # and they are reproducible


def test_chat_logprobs(server: Server) -> None:
    r = client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=6,
                                               logprobs=True, top_logprobs=2, **GREEDY)
    entries = r.choices[0].logprobs.content
    assert 1 <= len(entries) <= r.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2


# ---- scripted replies ----

def test_thinking_on_splits_reasoning_from_content(scripted: Server) -> None:
    r = client(scripted).chat.completions.create(model=MODEL, messages=USER)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING.strip()
    assert message.model_extra["reasoning"] == REASONING.strip()
    assert message.content == "You said: Hello there"
    assert r.choices[0].finish_reason == "stop"


def test_thinking_on_streams_reasoning_then_content(scripted: Server) -> None:
    chunks = list(client(scripted).chat.completions.create(model=MODEL, messages=USER,
                                                           stream=True))
    assert stream_text(chunks) == ("You said: Hello there", REASONING.strip())
    kinds = [("r" if getattr(c.choices[0].delta, "reasoning_content", None) else "c")
             for c in chunks[1:] if c.choices and (c.choices[0].delta.content or getattr(
                 c.choices[0].delta, "reasoning_content", None))]
    assert kinds == sorted(kinds, reverse=True)  # all reasoning deltas come first


@pytest.mark.parametrize("extra", [{"chat_template_kwargs": {"enable_thinking": False}},
                                   {"reasoning_effort": "none"}])
def test_thinking_off_has_no_reasoning(scripted: Server, extra: dict) -> None:
    r = client(scripted).chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
    message = r.choices[0].message
    assert message.content == "You said: Hello there"
    assert message.model_extra.get("reasoning_content") is None


def test_tool_call_round_trip(scripted: Server) -> None:
    c = client(scripted)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will call the tool."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    follow_up = [*ask, choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    r2 = c.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER_TOOL])
    assert r2.choices[0].message.content == "The tool said: 18 C and sunny"
    assert r2.choices[0].finish_reason == "stop"


def test_tool_calls_stream(scripted: Server) -> None:
    chunks = list(client(scripted).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL],
        stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert stream_text(chunks)[0] == "I will call the tool."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_leaves_tools_out(scripted: Server) -> None:
    r = client(scripted).chat.completions.create(model=MODEL, messages=USER,
                                                 tools=[WEATHER_TOOL], tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "You said: Hello there"


def test_stop_token_ids_end_generation(scripted: Server) -> None:
    tokens = httpx.post(f"{scripted.url}/tokenize", json={"prompt": "You said"}).json()["tokens"]
    r = client(scripted).chat.completions.create(
        model=MODEL, messages=USER, extra_body={"stop_token_ids": [tokens[-1]],
                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "stop"
    assert "You said" not in (r.choices[0].message.content or "")


@pytest.mark.parametrize("skip, said", [(None, "ab"), (False, "a<|vision_pad|>b")])
def test_special_tokens_are_left_out_unless_asked(scripted: Server, skip: bool | None,
                                                  said: str) -> None:
    extra: dict = {"chat_template_kwargs": {"enable_thinking": False}}
    if skip is not None:
        extra["skip_special_tokens"] = skip
    r = client(scripted).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a<|vision_pad|>b"}], extra_body=extra)
    assert r.choices[0].message.content == f"You said: {said}"


def test_completion_logprobs(server: Server) -> None:
    r = client(server).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                          logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert len(lp.text_offset) == 5 and lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)


def test_continuous_usage_stats(server: Server) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4, "stream": True,
            "ignore_eos": True, "stream_options": {"continuous_usage_stats": True}}
    r = httpx.post(f"{server.api}/completions", json=body)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
