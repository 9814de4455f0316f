"""Split generated text into reasoning (the <think> block) and content, incrementally.

Where generation starts is decided from the rendered prompt, never from request kwargs: the
Qwen3.5 template opens `<think>\\n` at the end of the prompt when thinking is on and writes an
empty, closed block when it is off. Deciding from kwargs is the root of known parser bugs
(answers returned as reasoning when a template closes the block by default; anchors.md §5E).
A completion cut off before `</think>` is all reasoning.

Whitespace at the start of each section and at the end of the reasoning is dropped (the template
surrounds the block with newlines). The rule only depends on the text, so a stream fed in any chunk
sizes yields exactly the whole-text split: the tail that might still become `</think>` or trailing
whitespace is held back until the next chunk or `flush`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ninfer_serve.textscan import partial_suffix, trailing_space

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# "reasoning": generation starts inside an open block; "content": the block was closed (or never
# exists); "detect": the prompt did neither, so the model may open a block as its first output.
StartMode = Literal["reasoning", "content", "detect"]


def start_mode(prompt: str) -> StartMode:
    """Where generation starts, judged from the end of the rendered prompt."""
    tail = prompt.rstrip()
    if tail.endswith(THINK_OPEN):
        return "reasoning"
    if tail.endswith(THINK_CLOSE):
        return "content"
    return "detect"


@dataclass(frozen=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Feed detokenized text in any chunking; get the reasoning and content parts of each chunk."""

    def __init__(self, mode: StartMode) -> None:
        self._state: StartMode = mode
        self._buf = ""
        self._lead = True  # at the start of a section: leading whitespace is dropped

    def feed(self, text: str) -> Split:
        self._buf += text
        return self._drain(final=False)

    def flush(self) -> Split:
        """Release everything held back (end of generation)."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._lead:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
            if self._state == "detect":
                if self._buf.startswith(THINK_OPEN):
                    self._buf = self._buf[len(THINK_OPEN) :]
                    self._state = "reasoning"
                    continue
                if THINK_OPEN.startswith(self._buf) and not final:
                    break
                self._state = "content"
                continue
            if self._state == "reasoning":
                end = self._buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(self._buf[:end].rstrip())
                    self._buf = self._buf[end + len(THINK_CLOSE) :]
                    self._state = "content"
                    self._lead = True
                    continue
                cut = len(self._buf)
                if not final:
                    cut -= partial_suffix(self._buf, THINK_CLOSE)
                    cut -= trailing_space(self._buf[:cut])
                self._emit(reasoning, self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            self._emit(content, self._buf)
            self._buf = ""
            break
        return Split("".join(reasoning), "".join(content))

    def _emit(self, parts: list[str], text: str) -> None:
        if text:
            parts.append(text)
            self._lead = False
