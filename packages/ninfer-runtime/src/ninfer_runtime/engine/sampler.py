"""Per-request sampling over a step's logits rows, and the logprobs callers ask for.

Each request keeps its own `SamplerState`: its parameters, its own torch.Generator (seeded from
`seed`, or from the OS when there is none), and, when a penalty is on, the token counts the
penalties read. A request's draws come only from its own generator, one per token, so its
tokens do not depend on what else is in the batch. Logprobs are the log_softmax of the raw
logits (before penalties and temperature, vLLM's default "raw" mode).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer_runtime.engine.request import AdmissionError, SamplingParams, TokenLogprob
from ninfer_runtime.ops.sampling import apply_penalties, filter_logits


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raises AdmissionError naming the first out-of-range parameter."""
    checks = [
        (params.temperature >= 0, "temperature must be >= 0"),
        (0.0 < params.top_p <= 1.0, "top_p must be in (0, 1]"),
        (params.top_k >= 0, "top_k must be >= 0 (0 = off)"),
        (0.0 <= params.min_p <= 1.0, "min_p must be in [0, 1]"),
        (params.repetition_penalty > 0, "repetition_penalty must be > 0"),
        (params.max_tokens >= 1, "max_tokens must be >= 1"),
        (params.logprobs is None or 0 <= params.logprobs <= vocab_size,
         f"logprobs must be in [0, {vocab_size}]"),
        (all(0 <= t < vocab_size for t in params.stop_token_ids),
         f"stop_token_ids must be in [0, {vocab_size})"),
    ]
    for ok, message in checks:
        if not ok:
            raise AdmissionError(f"invalid sampling parameters: {message}")


@dataclass(eq=False, slots=True)
class SamplerState:
    """One request's sampling: its parameters, generator and penalty counts."""

    params: SamplingParams
    generator: torch.Generator | None  # None for greedy requests
    seen: torch.Tensor | None = None  # [V] bool: prompt and output tokens (penalties only)
    counts: torch.Tensor | None = None  # [V] int32: output token counts (penalties only)

    @classmethod
    def create(cls, params: SamplingParams, prompt: Sequence[int], vocab_size: int,
               device: torch.device) -> SamplerState:
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            generator = torch.Generator(device).manual_seed(seed)
        state = cls(params, generator)
        if state.penalized:
            state.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            state.seen[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
            state.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        return state

    @property
    def penalized(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0)

    def record(self, token: int) -> None:
        if self.seen is not None and self.counts is not None:
            self.seen[token] = True
            self.counts[token] += 1


def _column(values: Sequence[float], like: torch.Tensor,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=like.device)


def sample(logits: torch.Tensor,
           states: Sequence[SamplerState]) -> list[tuple[int, TokenLogprob | None]]:
    """One token (and its logprobs when asked) per row of logits [R, V], row r drawn with
    states[r], whose counts it then updates."""
    raw = logits.float()
    scores = raw
    penalized = [i for i, s in enumerate(states) if s.penalized]
    if penalized:
        idx = torch.tensor(penalized, device=raw.device)
        sub = [states[i] for i in penalized]
        scores = raw.clone()
        scores[idx] = apply_penalties(
            raw[idx], torch.stack([s.seen for s in sub]), torch.stack([s.counts for s in sub]),
            *(_column([getattr(s.params, name) for s in sub], raw) for name in
              ("repetition_penalty", "frequency_penalty", "presence_penalty")))
    tokens = scores.argmax(-1)  # the greedy rows' answer; drawn rows are overwritten below
    drawn = [i for i, s in enumerate(states) if not s.params.greedy]
    if drawn:
        params = [states[i].params for i in drawn]
        scaled = scores[drawn] / _column([p.temperature for p in params], raw)[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            scaled = filter_logits(scaled, _column([p.top_k for p in params], raw, torch.int64),
                                   _column([p.top_p for p in params], raw),
                                   _column([p.min_p for p in params], raw))
        probs = scaled.softmax(-1)
        for row, i in enumerate(drawn):
            tokens[i] = torch.multinomial(probs[row], 1, generator=states[i].generator)[0]
    results = []
    for i, token in enumerate(tokens.tolist()):
        state = states[i]
        state.record(token)
        results.append((token, _logprobs(raw[i], token, state.params.logprobs)))
    return results


def _logprobs(raw: torch.Tensor, token: int, top: int | None) -> TokenLogprob | None:
    if top is None:
        return None
    logprobs = raw.log_softmax(-1)
    values, ids = logprobs.topk(top)
    return TokenLogprob(token, logprobs[token].item(),
                        tuple(zip(ids.tolist(), values.tolist(), strict=True)))
