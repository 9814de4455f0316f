"""A deterministic stand-in for ninfer_runtime.engine.Engine, for the server tests only.

It implements the engine contract (add_request / abort_request / step / has_unfinished /
intervals / queue_depth, tokenizer, generation_config, model_config) with the real stand-in
tokenizer of the tiny profiles, and "generates" a scripted reply: one token per step per running
request, the first one after a prefill step, at most `max_concurrency` running at once.

The default script behaves like a chat model on the Qwen3.5 template: it thinks (a reasoning
block closed by </think>) when the prompt opened a think block, calls `get_weather` when tools are
offered, answers a tool response by quoting it, and otherwise echoes the last user message.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.request import (
    AdmissionError,
    EngineRequest,
    RequestOutput,
    RequestStats,
    TokenLogprob,
)
from ninfer_runtime.profiles import get_profile
from ninfer_runtime.tokenizer import Tokenizer, load_standin

REASONING = "The user wants an answer. I will give one.\n"
TOOL_CALL = ("I will call the tool.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
             "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
CONTINUATION = " The quick brown fox jumps over the lazy dog."
FAULT_TRIGGER = "please crash"  # a prompt containing this makes step() raise


def scripted_reply(prompt: str) -> str:
    if "<|im_start|>assistant\n" not in prompt:
        return CONTINUATION
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
    admitted: float = 0.0
    produced: int = 0
    fault: bool = False


class FakeEngine:
    def __init__(self, config: EngineConfig | None = None, *, step_delay: float = 0.0,
                 script: Callable[[str], str] = scripted_reply) -> None:
        profile = get_profile("tiny_dense")
        tokenizer_json, template = load_standin("tiny")
        self.config = config or EngineConfig(max_context=2048, max_concurrency=4, device="cpu")
        self.tokenizer = Tokenizer.from_json(tokenizer_json, template, profile.generation_config)
        self.generation_config = dict(profile.generation_config)
        self.model_config = profile.config
        self._script = script
        self._step_delay = step_delay
        self._waiting: deque[_Running] = deque()
        self._running: dict[str, _Running] = {}
        self._intervals: dict[int, dict] = {}
        self.aborted: list[str] = []
        self._owner: threading.Thread | None = None

    # ---- contract ----

    def add_request(self, req: EngineRequest) -> None:
        self._check_thread()
        if len(req.prompt_token_ids) + req.sampling.max_tokens > self.config.max_context:
            raise AdmissionError(f"prompt + max_tokens exceeds max_context "
                                 f"{self.config.max_context}")
        prompt = self.tokenizer.decode(req.prompt_token_ids)
        reply = self.tokenizer.encode(self._script(prompt))
        self._waiting.append(_Running(req, reply, fault=FAULT_TRIGGER in prompt))

    def abort_request(self, request_id: str) -> None:
        self._check_thread()
        self.aborted.append(request_id)
        self._running.pop(request_id, None)
        self._waiting = deque(r for r in self._waiting if r.req.request_id != request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def queue_depth(self) -> int:
        return len(self._waiting)

    def intervals(self, since: float | None) -> list[dict]:
        return [r for r in self._intervals.values() if since is None or r["start"] >= since]

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        if self._step_delay:
            time.sleep(self._step_delay)
        now = time.perf_counter()
        while self._waiting and len(self._running) < self.config.max_concurrency:
            run = self._waiting.popleft()
            run.admitted = now
            run.stats.queue_seconds = now - run.req.arrival_time
            run.stats.prompt_tokens = len(run.req.prompt_token_ids)
            run.stats.computed_prefill_tokens = run.stats.prompt_tokens
            self._running[run.req.request_id] = run
        if any(run.fault for run in self._running.values()):
            raise RuntimeError("injected fault")
        outputs = [self._advance(run, now) for run in list(self._running.values())]
        self._record(outputs)
        return outputs

    # ---- internals ----

    def _advance(self, run: _Running, now: float) -> RequestOutput:
        sampling = run.req.sampling
        eos = self.tokenizer.eos_token_ids[0]
        if run.produced < len(run.reply):
            token = run.reply[run.produced]
        elif sampling.ignore_eos:
            token = run.reply[run.produced % len(run.reply)]
        else:
            token = eos
        run.produced += 1
        stats = run.stats
        if run.produced == 1:
            stats.prefill_seconds = now - run.admitted
        else:
            stats.decode_seconds = now - run.admitted - stats.prefill_seconds
        stats.completion_tokens = run.produced
        reason = None
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else {eos})
        if token in stops:
            reason = "stop"
        elif run.produced >= sampling.max_tokens:
            reason = "length"
        if reason is not None:
            del self._running[run.req.request_id]
        logprobs = None
        if sampling.logprobs is not None:
            top = tuple((t % self.model_config.vocab_size, -0.25 - i)
                        for i, t in enumerate(range(token, token + sampling.logprobs)))
            logprobs = (TokenLogprob(token, -0.25, top),)
        snapshot = RequestStats(**{k: getattr(stats, k) for k in RequestStats.__slots__})
        return RequestOutput(run.req.request_id, (token,), logprobs, reason is not None, reason,
                             snapshot)

    def _record(self, outputs: list[RequestOutput]) -> None:
        second = math.floor(time.time())
        record = self._intervals.setdefault(second, {"start": float(second), "seconds": 1.0,
                                                     "steps": 0, "decode_tokens": 0})
        record["steps"] += 1
        record["decode_tokens"] += sum(len(o.new_token_ids) for o in outputs)

    def _check_thread(self) -> None:
        """The real engine is not thread-safe: fail loudly if two threads ever touch it."""
        current = threading.current_thread()
        if self._owner is None:
            self._owner = current
        assert self._owner is current, "engine used from two threads"
