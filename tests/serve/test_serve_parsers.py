"""Pure unit tests: reasoning splitter, tool-call parser, stop strings and the text pipeline.

The streaming property: feeding any chunking of a text gives the same result as the whole text.
"""

from __future__ import annotations

import json
import random

import pytest
from fake_engine import standin_tokenizer

from ninfer_runtime.engine.request import TokenLogprob
from ninfer_serve.output import TextPipeline
from ninfer_serve.reasoning import ReasoningSplitter, Split, start_mode
from ninfer_serve.textscan import StopMatcher, partial_suffix
from ninfer_serve.tools import ToolCallParser, convert_value

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "where": {"type": "object"},
        "note": {"type": ["string", "null"]}}}}}]


def chunkings(text: str, seeds: int = 40) -> list[list[str]]:
    """Whole, one character at a time, and random cuts."""
    out = [[text], list(text)]
    for seed in range(seeds):
        rng = random.Random(seed)
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


def split_all(mode: str, pieces: list[str]) -> Split:
    splitter = ReasoningSplitter(mode)  # type: ignore[arg-type]
    parts = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    return Split("".join(p.reasoning for p in parts), "".join(p.content for p in parts))


# ---- reasoning ----

@pytest.mark.parametrize("prompt, mode", [
    ("<|im_start|>assistant\n<think>\n", "reasoning"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "content"),
    ("<|im_start|>assistant\n", "detect"),
    ("<think>\nold\n</think>\n\nanswer<|im_end|>\n<|im_start|>assistant\n", "detect"),
])
def test_start_mode_is_read_from_the_end_of_the_prompt(prompt: str, mode: str) -> None:
    assert start_mode(prompt) == mode


@pytest.mark.parametrize("mode, text, reasoning, content", [
    ("reasoning", "Let me think.\nYes.\n</think>\n\nThe answer is 4.",
     "Let me think.\nYes.", "The answer is 4."),
    ("reasoning", "cut off while thinking  ", "cut off while thinking  ", ""),
    ("content", "  Plain answer </think> stays.", "", "Plain answer </think> stays."),
    ("detect", "\n<think>\nhmm\n</think>\n\nok", "hmm", "ok"),
    ("detect", "no block here <think>", "", "no block here <think>"),
    ("detect", "<thi", "", "<thi"),
    ("reasoning", "a </thinking> b </think>c", "a </thinking> b", "c"),
])
def test_reasoning_split_is_the_same_for_every_chunking(mode: str, text: str, reasoning: str,
                                                        content: str) -> None:
    for pieces in chunkings(text):
        assert split_all(mode, pieces) == Split(reasoning, content), pieces


# ---- tool calls ----

def parse_all(text: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    parser = ToolCallParser(TOOLS)
    parts = [parser.feed(p) for p in pieces] + [parser.flush()]
    calls: dict[int, list[str]] = {}
    for part in parts:
        for d in part.calls:
            if d.name is not None:
                assert d.index not in calls, "a call is named once"
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return "".join(p.content for p in parts), [tuple(calls[i]) for i in sorted(calls)]


XML_TWO_CALLS = (
    "I'll check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
    "<parameter=where>\n{\"lat\": 1.5}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\n"
    "multi\nline <b>\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("text, content, calls", [
    (XML_TWO_CALLS, "I'll check both.", [
        ("get_weather", {"city": "New York", "days": 3, "metric": True, "where": {"lat": 1.5},
                         "note": None}),
        ("get_time", {"zone": "multi\nline <b>"})]),
    ("<tool_call>\n<function=noop>\n</function>\n</tool_call>", "", [("noop", {})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "",
     [("get_weather", {"city": "Oslo"})]),
    # a value cut off by the end of generation is dropped; the call is still closed
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
     "<parameter=days>\n2", "", [("get_weather", {"city": "Rome"})]),
    # missing </parameter>: the next tag ends the value
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n<parameter=days>\n5\n"
     "</function>\n</tool_call>", "", [("get_weather", {"city": "Lima", "days": 5})]),
    ("no calls, just <tool text> and <tool_c", "no calls, just <tool text> and <tool_c", []),
    ("<tool_call>\nnot a call\n", "<tool_call>not a call\n", []),
    ("before <tool_call>", "before<tool_call>", []),
])
def test_tool_calls_parse_the_same_for_every_chunking(text: str, content: str,
                                                      calls: list) -> None:
    for pieces in chunkings(text):
        got_content, got_calls = parse_all(text, pieces)
        assert got_content == content, pieces
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, pieces


def test_argument_fragments_concatenate_to_the_json_object() -> None:
    _, calls = parse_all(XML_TWO_CALLS, [XML_TWO_CALLS])
    name, arguments = calls[0]
    assert arguments == json.dumps(json.loads(arguments), ensure_ascii=False)


@pytest.mark.parametrize("raw, schema, value", [
    ("42", {"type": "integer"}, 42),
    ("4.5", {"type": "number"}, 4.5),
    ("forty", {"type": "integer"}, "forty"),
    ("42", {"type": "string"}, "42"),
    ("false", {"type": "boolean"}, False),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("not json", {"type": "object"}, "not json"),
    ("7", None, "7"),
])
def test_parameter_values_follow_the_schema(raw: str, schema: dict | None, value: object) -> None:
    assert convert_value(raw, schema) == value


# ---- stop strings ----

@pytest.mark.parametrize("text, stops, out, stopped", [
    ("Hello world. Bye", ("world",), "Hello ", True),
    ("abcabd", ("abd", "bca"), "a", True),
    ("no stop here", ("zzz",), "no stop here", False),
    ("ends with wor", ("world",), "ends with wor", False),
])
def test_stop_strings_cut_before_the_first_match(text: str, stops: tuple[str, ...], out: str,
                                                 stopped: bool) -> None:
    for pieces in chunkings(text):
        matcher = StopMatcher(stops)
        got = "".join(matcher.feed(p) for p in pieces)
        if not matcher.stopped:
            got += matcher.flush()
        assert (got, matcher.stopped) == (out, stopped), pieces


def test_partial_suffix() -> None:
    assert partial_suffix("abc</th", "</think>") == 4
    assert partial_suffix("abc", "</think>") == 0
    assert partial_suffix("</think>", "</think>") == 0  # a whole marker is not partial


# ---- the whole pipeline, on the stand-in tokenizer ----

@pytest.fixture(scope="module")
def tokenizer():
    return standin_tokenizer()


def test_pipeline_hides_stop_tokens_and_splits_multibyte_safely(tokenizer) -> None:
    text = "Ünïcödé ✓ thinking</think>\n\nDone 😀"
    ids = tokenizer.encode(text) + list(tokenizer.eos_token_ids[:1])
    for step in (1, 2, 5):
        pipeline = TextPipeline(tokenizer, stop=(), hidden_ids=tokenizer.eos_token_ids,
                                reasoning="reasoning")
        deltas = [pipeline.feed(ids[i:i + step]) for i in range(0, len(ids), step)]
        deltas.append(pipeline.flush())
        assert all("\ufffd" not in d.content + d.reasoning for d in deltas)
        assert "".join(d.reasoning for d in deltas) == "Ünïcödé ✓ thinking"
        assert "".join(d.content for d in deltas) == "Done 😀"


def test_pipeline_stop_string_ends_the_choice(tokenizer) -> None:
    ids = tokenizer.encode("one two three four")
    pipeline = TextPipeline(tokenizer, stop=("three",), hidden_ids=())
    out = ""
    for token in ids:
        out += pipeline.feed([token]).content
        if pipeline.stopped:
            break
    assert pipeline.stopped and out == "one two "
    assert not pipeline.feed(ids)  # nothing after the stop


def test_pipeline_keeps_logprobs_of_visible_tokens(tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("hi") + [eos]
    lps = [TokenLogprob(t, -1.0) for t in ids]
    delta = TextPipeline(tokenizer, stop=(), hidden_ids={eos}).feed(ids, lps)
    assert [lp.token_id for lp in delta.logprobs] == ids[:-1]


def test_pipeline_finds_tool_calls_in_reasoning_and_content(tokenizer) -> None:
    text = ("thinking <tool_call>\n<function=a>\n</function>\n</tool_call></think>\n\nok "
            "<tool_call>\n<function=b>\n</function>\n</tool_call>")
    pipeline = TextPipeline(tokenizer, stop=(), hidden_ids=(), reasoning="reasoning",
                            tools=TOOLS)
    delta = pipeline.feed(tokenizer.encode(text)) + pipeline.flush()
    assert delta.reasoning == "thinking" and delta.content == "ok"
    assert [(d.index, d.name) for d in delta.tool_calls if d.name] == [(0, "a"), (1, "b")]
