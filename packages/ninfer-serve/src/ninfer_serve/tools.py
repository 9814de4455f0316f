"""Parse Qwen tool calls out of generated text, incrementally.

Qwen3.5 writes calls in an XML style (the `qwen3_coder` format, qwen_arch.md §5):

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Older Qwen models put a JSON object `{"name": ..., "arguments": {...}}` between the tool_call
tags; that form is accepted too. A call is committed (its name is emitted) as soon as its
`<function=NAME>` header is complete; each parameter is emitted when its value is closed, as the
next fragment of the JSON arguments string, so the fragments of one call concatenate to
`json.dumps(arguments)`. Parameter values are converted with the tool's JSON schema (a `string`
parameter stays text; numbers, booleans, objects and arrays are parsed when they parse).

Text outside calls is content; whitespace between content and a call is dropped. Like the reasoning
splitter, the result depends only on the text, not on how it was chunked.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ninfer_serve.textscan import partial_suffix, trailing_space

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
FUNC_OPEN = "<function="
FUNC_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
# A parameter value ends at its closing tag, or (when the model leaves it out) at the next tag.
_VALUE_ENDS = (PARAM_CLOSE, PARAM_OPEN, FUNC_CLOSE, TOOL_CLOSE)
_LONGEST_END = max(map(len, _VALUE_ENDS))

_State = Literal["text", "call", "json", "function", "param", "after"]


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position among all calls of the completion
    name: str | None = None  # set on the first delta of a call only
    arguments: str = ""  # the next fragment of the call's JSON arguments string


@dataclass(frozen=True)
class ToolParse:
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


def parameter_types(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name: JSON schema} from OpenAI tool definitions."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") or {}
        props = (function.get("parameters") or {}).get("properties") or {}
        out[str(function.get("name"))] = {k: v for k, v in props.items() if isinstance(v, dict)}
    return out


def convert_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the JSON value its schema asks for; text when it does not parse."""
    if schema is None:
        return raw
    kind = schema.get("type")
    if isinstance(kind, list):  # e.g. ["string", "null"]: the first non-null type decides
        kind = next((k for k in kind if k != "null"), None)
    if raw.strip() == "null":
        return None
    if kind == "string":
        return raw
    if kind == "boolean":
        lowered = raw.strip().lower()
        return lowered == "true" if lowered in ("true", "false") else raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if kind in ("integer", "number") and not isinstance(value, int | float):
        return raw
    return value


class ToolCallParser:
    """Feed text in any chunking; get content text and tool-call deltas.

    `counter` numbers the calls; pass one shared counter to the parsers of a completion's
    reasoning and content so that calls found in either get distinct, ordered indices.
    """

    def __init__(self, tools: Sequence[dict[str, Any]], counter: Iterator[int] | None = None):
        self._types = parameter_types(tools)
        self._counter = counter if counter is not None else itertools.count()
        self._state: _State = "text"
        self._buf = ""
        self._lead = False  # drop leading whitespace (right after a call)
        self._index = -1
        self._function = ""
        self._param = ""
        self._has_args = False
        # Values can be long (a whole file for a write tool): text before this offset of the
        # buffer was already searched for an end tag, so each feed scans only the new text.
        self._scanned = 0

    def feed(self, text: str) -> ToolParse:
        self._buf += text
        return self._drain(final=False)

    def flush(self) -> ToolParse:
        """End of generation: release held text and close a call that was cut off."""
        parse = self._drain(final=True)
        if self._state in ("call", "json"):  # a bare <tool_call> at the very end
            parse = ToolParse(parse.content + TOOL_OPEN, parse.calls)
        elif self._state in ("function", "param"):
            closing = ToolCallDelta(self._index, arguments=self._close_args())
            parse = ToolParse(parse.content, (*parse.calls, closing))
        self._state, self._buf, self._scanned = "text", "", 0  # a cut-off value is dropped
        return parse

    def _drain(self, final: bool) -> ToolParse:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if self._lead or self._state in ("call", "function", "after"):
                self._buf = self._buf.lstrip()
            if not self._buf:
                break
            self._lead = False
            if self._state == "text":
                start = self._buf.find(TOOL_OPEN)
                if start >= 0:
                    content.append(self._buf[:start].rstrip())
                    self._buf = self._buf[start + len(TOOL_OPEN) :]
                    self._state = "call"
                    continue
                cut = len(self._buf)
                if not final:
                    cut -= partial_suffix(self._buf, TOOL_OPEN)
                    cut -= trailing_space(self._buf[:cut])
                content.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            if self._state == "call":
                if not self._header(calls, content, final):
                    break
            elif self._state == "json":
                if not self._json_call(calls, content, final):
                    break
            elif self._state == "function":
                if not self._function_body(calls, final):
                    break
            elif self._state == "param":
                if not self._param_value(calls):
                    break
            elif not self._after(final):
                break
        return ToolParse("".join(content), tuple(calls))

    # Each step below consumes input and returns True, or returns False to wait for more text.

    def _header(self, calls: list[ToolCallDelta], content: list[str], final: bool) -> bool:
        buf = self._buf
        if buf.startswith(FUNC_OPEN):
            end = buf.find(">", len(FUNC_OPEN))
            if end >= 0:
                self._function = buf[len(FUNC_OPEN) : end].strip()
                self._index = next(self._counter)
                self._has_args = False
                calls.append(ToolCallDelta(self._index, name=self._function))
                self._buf = buf[end + 1 :]
                self._state = "function"
                return True
        elif buf.startswith("{"):
            self._state = "json"
            return True
        elif not FUNC_OPEN.startswith(buf):
            final = True  # not a call after all
        if not final:
            return False
        content.append(TOOL_OPEN + buf)
        self._buf = ""
        self._state = "text"
        return True

    def _json_call(self, calls: list[ToolCallDelta], content: list[str], final: bool) -> bool:
        end = self._buf.find(TOOL_CLOSE, self._resume(len(TOOL_CLOSE)))
        if end < 0 and not final:
            self._scanned = len(self._buf)
            return False
        self._scanned = 0
        body = self._buf if end < 0 else self._buf[:end]
        self._buf = "" if end < 0 else self._buf[end + len(TOOL_CLOSE) :]
        self._state = "text"
        self._lead = True
        try:
            call = json.loads(body)
            name = call["name"]
            args = call.get("arguments", {})
        except (ValueError, KeyError, TypeError, AttributeError):
            content.append(TOOL_OPEN + body + ("" if end < 0 else TOOL_CLOSE))
            return True
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCallDelta(next(self._counter), name=str(name), arguments=arguments))
        return True

    def _function_body(self, calls: list[ToolCallDelta], final: bool) -> bool:
        buf = self._buf
        if buf.startswith(PARAM_OPEN):
            end = buf.find(">", len(PARAM_OPEN))
            if end < 0:
                return self._skip_junk(final)
            self._param = buf[len(PARAM_OPEN) : end].strip()
            self._buf = buf[end + 1 :]
            self._state = "param"
            return True
        for tag, state in ((FUNC_CLOSE, "after"), (TOOL_CLOSE, "text")):
            if buf.startswith(tag):
                calls.append(ToolCallDelta(self._index, arguments=self._close_args()))
                self._buf = buf[len(tag) :]
                self._state = state
                self._lead = True
                return True
        if any(tag.startswith(buf) for tag in (PARAM_OPEN, FUNC_CLOSE, TOOL_CLOSE)):
            return self._skip_junk(final)
        return self._skip_junk(final=True)

    def _skip_junk(self, final: bool) -> bool:
        """Drop stray text inside a function body, up to the next tag."""
        if not final:
            return False
        nxt = self._buf.find("<", 1)
        self._buf = "" if nxt < 0 else self._buf[nxt:]
        return True

    def _param_value(self, calls: list[ToolCallDelta]) -> bool:
        start = self._resume(_LONGEST_END)
        found = [(pos, tag) for tag in _VALUE_ENDS if (pos := self._buf.find(tag, start)) >= 0]
        if not found:
            self._scanned = len(self._buf)
            return False
        self._scanned = 0
        end, tag = min(found)
        raw = self._buf[:end]
        self._buf = self._buf[end + len(PARAM_CLOSE) :] if tag == PARAM_CLOSE else self._buf[end:]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        schema = self._types.get(self._function, {}).get(self._param)
        value = convert_value(raw, schema)
        item = f"{json.dumps(self._param, ensure_ascii=False)}: "
        item += json.dumps(value, ensure_ascii=False)
        calls.append(ToolCallDelta(self._index, arguments=(", " if self._has_args else "{") + item))
        self._has_args = True
        self._state = "function"
        return True

    def _after(self, final: bool) -> bool:
        if self._buf.startswith(TOOL_CLOSE):
            self._buf = self._buf[len(TOOL_CLOSE) :]
        elif TOOL_CLOSE.startswith(self._buf) and not final:
            return False
        self._state = "text"  # a missing </tool_call> is tolerated
        self._lead = True
        return True

    def _resume(self, tag_length: int) -> int:
        """Where to search for a tag of `tag_length` chars: it may straddle the old end."""
        return max(0, self._scanned - tag_length + 1)

    def _close_args(self) -> str:
        return "}" if self._has_args else "{}"
