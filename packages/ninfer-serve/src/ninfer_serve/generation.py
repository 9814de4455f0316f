"""One API request in flight: its n engine requests, their outputs, usage and statistics.

The n choices share one asyncio queue; `deltas()` turns their outputs into per-choice text deltas
and finishes each choice when the engine finishes it or a stop string appears (then the engine
request is aborted at once, freeing its slot). `close()` aborts whatever is unfinished; callers
run it in `finally`, so a client that goes away releases its slots.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer_runtime.engine.request import (
    AdmissionError,
    EngineRequest,
    RequestOutput,
    RequestStats,
    SamplingParams,
)
from ninfer_serve.client import EngineClient, EngineUnavailable
from ninfer_serve.errors import APIError
from ninfer_serve.metrics import Metrics
from ninfer_serve.output import Delta, TextPipeline

_TIMINGS = ("queue_seconds", "prepare_seconds", "vision_seconds", "prefill_seconds",
            "decode_seconds")


@dataclass
class Choice:
    index: int
    request_id: str
    pipeline: TextPipeline
    finish_reason: str | None = None  # the engine's reason ("stop" for a stop string too)
    error: str | None = None
    tokens: int = 0  # tokens delivered
    stats: RequestStats = field(default_factory=RequestStats)
    last_delivery: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Generation:
    def __init__(self, client: EngineClient, metrics: Metrics, *, request_id: str,
                 prompt_ids: Sequence[int], params: Sequence[SamplingParams],
                 pipelines: Sequence[TextPipeline], arrival: float) -> None:
        self._client = client
        self._metrics = metrics
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._prompt = tuple(prompt_ids)
        self._params = tuple(params)
        self._arrival = arrival
        self.request_id = request_id
        self.choices = [Choice(i, f"{request_id}-{i}", p) for i, p in enumerate(pipelines)]
        self._by_id = {c.request_id: c for c in self.choices}
        self._submitted: list[Choice] = []

    @property
    def prompt_tokens(self) -> int:
        return len(self._prompt)

    async def start(self) -> None:
        """Submit the n engine requests; a request the engine can never run is a 400."""
        try:
            for choice, params in zip(self.choices, self._params, strict=True):
                request = EngineRequest(choice.request_id, self._prompt, params, self._arrival)
                await self._client.add(request, self._queue)
                self._submitted.append(choice)
        except AdmissionError as e:
            self.close()
            raise APIError(400, f"request cannot be served: {e}") from e
        except EngineUnavailable as e:
            self.close()
            raise APIError(503, str(e)) from e
        except BaseException:
            self.close()
            raise

    async def deltas(self) -> AsyncIterator[tuple[Choice, Delta]]:
        """(choice, its new text) per engine output, until every choice is finished."""
        while not all(c.done for c in self.choices):
            output = await self._queue.get()
            choice = self._by_id.get(output.request_id)
            if choice is None or choice.done:
                continue  # outputs queued before a stop-string abort took effect
            delta = self._deliver(choice, output)
            if choice.pipeline.stopped:
                self._client.abort(choice.request_id)
                self._finish(choice, "stop")
            elif output.finished:
                delta = delta + choice.pipeline.flush()
                self._finish(choice, output.finish_reason or "stop", output.error)
            yield choice, delta

    def close(self) -> None:
        """Abort the choices that have not finished (a client that left, or a failed start)."""
        for choice in self.choices:
            if not choice.done:
                if choice in self._submitted:
                    self._client.abort(choice.request_id)
                    self._finish(choice, "abort")
                else:
                    choice.finish_reason = "abort"

    def _deliver(self, choice: Choice, output: RequestOutput) -> Delta:
        now = time.perf_counter()
        choice.stats = output.stats
        count = len(output.new_token_ids)
        if count and choice.tokens == 0:
            self._metrics.first_token(now - self._arrival, self.prompt_tokens,
                                      output.stats.cached_prompt_tokens)
        if count:
            gap = None if choice.last_delivery is None else now - choice.last_delivery
            self._metrics.tokens(count, gap)
            choice.tokens += count
            choice.last_delivery = now
        return choice.pipeline.feed(output.new_token_ids, output.new_logprobs)

    def _finish(self, choice: Choice, reason: str, error: str | None = None) -> None:
        choice.finish_reason = reason
        choice.error = error
        choice.pipeline.done = True
        self._metrics.finished(reason, time.perf_counter() - self._arrival, choice.stats)

    # ---- what the responses report ----

    def usage(self) -> dict[str, Any]:
        """OpenAI usage: the prompt counts once, completion tokens over all choices."""
        completion = sum(c.tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.choices[0].stats.cached_prompt_tokens},
        }

    def ninfer(self, finish_reason: str | None) -> dict[str, Any]:
        """NInfer's per-request record (the bench computes its rates from these).

        With n > 1, token counts and speculative counters are summed over the choices and each
        phase time is the longest choice's, since the choices run side by side.
        """
        stats = [c.stats for c in self.choices]
        per_position: list[int] = []
        for s in stats:
            for i, accepted in enumerate(s.spec.accepted_per_position):
                if i == len(per_position):
                    per_position.append(0)
                per_position[i] += accepted
        return {
            "prompt_tokens": self.prompt_tokens,
            "computed_prefill_tokens": sum(s.computed_prefill_tokens for s in stats),
            "cached_prompt_tokens": sum(s.cached_prompt_tokens for s in stats),
            "completion_tokens": sum(c.tokens for c in self.choices),
            "finish_reason": finish_reason,
            "timings": {k: max(getattr(s, k) for s in stats) for k in _TIMINGS},
            "spec": {
                "drafted_tokens": sum(s.spec.drafted_tokens for s in stats),
                "accepted_tokens": sum(s.spec.accepted_tokens for s in stats),
                "rounds": sum(s.spec.rounds for s in stats),
                "accepted_per_position": per_position,
            },
        }

    def error(self) -> str | None:
        """The first engine fault among the choices, if any."""
        return next((c.error or "engine error" for c in self.choices
                     if c.finish_reason == "error"), None)
