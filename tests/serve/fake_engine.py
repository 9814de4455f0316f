"""A deterministic stand-in for ninfer_runtime.engine.Engine, for the server tests only.

It implements the engine contract (add_request / abort_request / step / has_unfinished /
intervals / queue_depth, tokenizer, generation_config, model_config) with the real stand-in
tokenizer of the tiny profiles, and "generates" a scripted reply: one token per step per running
request, the first one after a prefill step, at most `max_concurrency` running at once.

The script behaves like a chat model on the Qwen3.5 template: it thinks (a reasoning
block closed by </think>) when the prompt opened a think block, calls `get_weather` when tools are
offered, answers a tool response by quoting it, and otherwise echoes the last user message.
Everything else the server tests check runs on the real engine (serve_helpers.real_engine).
"""

from __future__ import annotations

import copy
import re
import threading
from collections import deque
from dataclasses import dataclass, field

from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.request import (
    AdmissionError,
    EngineRequest,
    RequestOutput,
    RequestStats,
)
from ninfer_runtime.profiles import get_profile
from ninfer_runtime.tokenizer import Tokenizer, load_standin

REASONING = "The user wants an answer. I will give one.\n"
TOOL_CALL = ("I will call the tool.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
             "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def standin_tokenizer() -> Tokenizer:
    """The tiny profiles' stand-in tokenizer (the one the default artifact carries)."""
    tokenizer_json, template = load_standin("tiny")
    generation_config = get_profile("tiny_dense").generation_config
    return Tokenizer.from_json(tokenizer_json, template, generation_config)


def scripted_reply(prompt: str) -> str:
    """The reply to a prompt rendered by the chat template."""
    turns = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, flags=re.S)
    last = turns[-1] if turns else ""
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last, flags=re.S)
    if responses:
        answer = f"The tool said: {responses[-1]}"
    elif "<tools>" in prompt:
        answer = TOOL_CALL
    else:
        answer = f"You said: {last}"
    thinking = prompt.rstrip().endswith("<think>")
    return (REASONING + "</think>\n\n" if thinking else "") + answer


@dataclass
class _Running:
    req: EngineRequest
    reply: list[int]
    stats: RequestStats = field(default_factory=RequestStats)
    produced: int = 0


class FakeEngine:
    def __init__(self, config: EngineConfig) -> None:
        profile = get_profile("tiny_dense")
        self.config = config
        self.tokenizer = standin_tokenizer()
        self.generation_config = dict(profile.generation_config)
        self.model_config = profile.config
        self._waiting: deque[_Running] = deque()
        self._running: dict[str, _Running] = {}
        self._owner: threading.Thread | None = None

    # ---- contract ----

    def add_request(self, req: EngineRequest) -> None:
        self._check_thread()
        if len(req.prompt_token_ids) + req.sampling.max_tokens > self.config.max_context:
            raise AdmissionError(f"prompt + max_tokens exceeds max_context "
                                 f"{self.config.max_context}")
        prompt = self.tokenizer.decode(req.prompt_token_ids)
        reply = self.tokenizer.encode(scripted_reply(prompt))
        self._waiting.append(_Running(req, reply))

    def abort_request(self, request_id: str) -> None:
        self._check_thread()
        self._running.pop(request_id, None)
        self._waiting = deque(r for r in self._waiting if r.req.request_id != request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def queue_depth(self) -> int:
        return len(self._waiting)

    def intervals(self, since: float | None) -> list[dict]:
        return []  # the interval records are tested on the real engine

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        while self._waiting and len(self._running) < self.config.max_concurrency:
            run = self._waiting.popleft()
            run.stats.prompt_tokens = run.stats.computed_prefill_tokens = len(
                run.req.prompt_token_ids)
            self._running[run.req.request_id] = run
        return [self._advance(run) for run in list(self._running.values())]

    # ---- internals ----

    def _advance(self, run: _Running) -> RequestOutput:
        """The next scripted token; eos once the script is over."""
        sampling = run.req.sampling
        eos = self.tokenizer.eos_token_ids[0]
        token = run.reply[run.produced] if run.produced < len(run.reply) else eos
        run.produced += 1
        run.stats.completion_tokens = run.produced
        reason = None
        if token == eos or token in sampling.stop_token_ids:
            reason = "stop"
        elif run.produced >= sampling.max_tokens:
            reason = "length"
        if reason is not None:
            del self._running[run.req.request_id]
        return RequestOutput(run.req.request_id, (token,), None, reason is not None, reason,
                             copy.deepcopy(run.stats))

    def _check_thread(self) -> None:
        """The real engine is not thread-safe: fail loudly if two threads ever touch it."""
        current = threading.current_thread()
        if self._owner is None:
            self._owner = current
        assert self._owner is current, "engine used from two threads"
