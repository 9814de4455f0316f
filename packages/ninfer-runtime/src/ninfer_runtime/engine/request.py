"""Plain records exchanged between the engine and its callers (the server, the LLM API).

The engine takes `EngineRequest`s and, at every step, returns one `RequestOutput` per request
that produced tokens or finished. Everything here is plain data: no tensors, no engine state.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling, OpenAI/vLLM semantics. temperature 0 means greedy (argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's eos ids
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + top-k alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float  # time.perf_counter() when the server received it


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(slots=True)
class SpecCounters:
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestStats:
    """Token counts and unrounded phase timings (seconds) of one request."""

    prompt_tokens: int = 0
    computed_prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float = 0.0
    prepare_seconds: float = 0.0
    vision_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    spec: SpecCounters = field(default_factory=SpecCounters)

    def snapshot(self) -> RequestStats:
        """A copy later steps leave alone (each RequestOutput carries one); copy.deepcopy
        took ~0.1 ms, a step's every output."""
        spec = replace(self.spec, accepted_per_position=list(self.spec.accepted_per_position))
        return replace(self, spec=spec)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...] | None
    finished: bool
    finish_reason: FinishReason | None
    stats: RequestStats
    error: str | None = None  # set with finish_reason "error"


class AdmissionError(ValueError):
    """A request that can never run on this engine (too long for the KV pool or context)."""
