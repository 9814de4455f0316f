"""The text path of one choice: token ids -> text -> stop strings -> reasoning -> tool calls.

Every stage is incremental and holds back only what the next chunk could change, so a streamed
response carries exactly the text, reasoning and calls of the non-streamed one.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ninfer_runtime.engine.request import TokenLogprob
from ninfer_serve.reasoning import ReasoningSplitter, StartMode
from ninfer_serve.textscan import StopMatcher
from ninfer_serve.tools import ToolCallDelta, ToolCallParser


@dataclass(frozen=True)
class Delta:
    content: str = ""  # chat content, or the text of a text completion
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.content + other.content, self.reasoning + other.reasoning,
                     self.tool_calls + other.tool_calls, self.logprobs + other.logprobs)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)


class TextPipeline:
    """One choice's output text.

    `hidden_ids` (the stop tokens) never reach the text: the engine stops on them, and OpenAI
    semantics leave the stop out. With `skip_special_tokens` the tokenizer's special tokens are
    left out too. `reasoning` is where generation starts (None: no split, as
    for text completions); `tools` are the request's tool definitions (None: no parsing).
    """

    def __init__(self, tokenizer: Any, *, stop: tuple[str, ...], hidden_ids: Collection[int],
                 reasoning: StartMode | None = None,
                 tools: Sequence[dict[str, Any]] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._detok = tokenizer.detokenizer(skip_special_tokens)
        self._hidden = frozenset(hidden_ids)
        self._stops = StopMatcher(stop)
        self._splitter = ReasoningSplitter(reasoning) if reasoning is not None else None
        counter = itertools.count()  # one numbering for calls found in reasoning and content
        self._content_tools = ToolCallParser(tools, counter) if tools else None
        # Qwen models sometimes call tools without closing the think block; such calls still
        # count (anchors.md §5D: calls lost inside <think>).
        self._reasoning_tools = ToolCallParser(tools, counter) if tools and reasoning else None
        self.done = False

    @property
    def stopped(self) -> bool:
        """A stop string ended the text; the engine request should be aborted."""
        return self._stops.stopped

    def feed(self, token_ids: Sequence[int],
             logprobs: Sequence[TokenLogprob] | None = None) -> Delta:
        if self.done:
            return Delta()
        visible = [t for t in token_ids if t not in self._hidden]
        kept = tuple(lp for lp in logprobs or () if lp.token_id not in self._hidden)
        text = self._stops.feed(self._detok.add(visible))
        delta = self._route(text, final=self._stops.stopped)
        return Delta(delta.content, delta.reasoning, delta.tool_calls, kept)

    def flush(self) -> Delta:
        """End of generation: everything held back."""
        if self.done:
            return Delta()
        text = self._stops.feed(self._detok.flush())
        if not self._stops.stopped:
            text += self._stops.flush()
        return self._route(text, final=True)

    def _route(self, text: str, final: bool) -> Delta:
        self.done = final
        if self._splitter is None:
            reasoning, content = "", text
        else:
            split = self._splitter.feed(text)
            reasoning, content = split.reasoning, split.content
            if final:
                rest = self._splitter.flush()
                reasoning, content = reasoning + rest.reasoning, content + rest.content
        reasoning, reasoning_calls = _parse(self._reasoning_tools, reasoning, final)
        content, content_calls = _parse(self._content_tools, content, final)
        return Delta(content, reasoning, reasoning_calls + content_calls)


def _parse(parser: ToolCallParser | None, text: str,
           final: bool) -> tuple[str, tuple[ToolCallDelta, ...]]:
    if parser is None:
        return text, ()
    parse = parser.feed(text)
    if final:
        tail = parser.flush()
        return parse.content + tail.content, parse.calls + tail.calls
    return parse.content, parse.calls
