"""Per-request sampling over a step's logits rows, and the logprobs callers ask for.

Each request keeps its own `SamplerState`: its parameters, its seed (`seed`, or one drawn from
the OS when there is none), a step counter, and, when a penalty is on, its prompt tokens and
output token counts as device tensors. A step samples every row at once on the logits' device
(ops.sampling.sample_rows): a request's draw depends only on its seed, its step and its logits
row, so its tokens do not depend on what else is in the batch. Nothing waits for the device
until the sampled ids (and the requested logprobs) come back in one copy at the end.
Logprobs are the log_softmax of the raw logits (before penalties and temperature, vLLM's
default "raw" mode).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer_runtime.engine.request import AdmissionError, SamplingParams, TokenLogprob
from ninfer_runtime.ops.sampling import RowSampling, apply_penalties, sample_rows


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
    """One request's sampling: its parameters, seed and step, and its penalty inputs."""

    params: SamplingParams
    seed: int
    step: int = 0  # tokens sampled so far: the counter of the request's noise
    prompt: torch.Tensor | None = None  # [V] bool: prompt tokens (penalties only)
    counts: torch.Tensor | None = None  # [V] int32: output token counts (penalties only)

    @classmethod
    def create(cls, params: SamplingParams, prompt: Sequence[int], vocab_size: int,
               device: torch.device) -> SamplerState:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        state = cls(params, seed)
        if state.penalized:
            state.prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            state.prompt[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
            state.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        return state

    @property
    def penalized(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0)

    @property
    def seen(self) -> torch.Tensor | None:
        """[V] bool: the prompt and output tokens, which the repetition penalty hits."""
        if self.prompt is None or self.counts is None:
            return None
        return self.prompt | (self.counts > 0)


def _to(device: torch.device, values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """A host list on `device`, without waiting for the device."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _penalised(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """The logits with each penalised row's penalties applied (a copy when any is)."""
    rows = [i for i, s in enumerate(states) if s.penalized]
    if not rows:
        return logits
    sub = [states[i] for i in rows]
    idx = _to(logits.device, rows, torch.int64)
    rep, freq, pres = _to(logits.device, [[s.params.repetition_penalty for s in sub],
                                          [s.params.frequency_penalty for s in sub],
                                          [s.params.presence_penalty for s in sub]],
                          torch.float32)
    penalised = apply_penalties(logits.index_select(0, idx), torch.stack([s.prompt for s in sub]),
                                torch.stack([s.counts for s in sub]), rep, freq, pres)
    return logits.to(torch.float32, copy=True).index_copy_(0, idx, penalised)


def sample(logits: torch.Tensor,
           states: Sequence[SamplerState]) -> list[tuple[int, TokenLogprob | None]]:
    """One token (and its logprobs when asked) per row of logits [R, V], row r drawn with
    states[r], whose step and counts it then advances."""
    device, vocab = logits.device, logits.shape[-1]
    params = [s.params for s in states]
    rows = RowSampling.build([p.temperature for p in params], [p.top_k for p in params],
                             [p.top_p for p in params], [p.min_p for p in params],
                             [s.seed for s in states], [s.step for s in states], vocab, device)
    tokens = sample_rows(_penalised(logits, states), rows)
    one = None
    for i, state in enumerate(states):
        state.step += 1
        if state.counts is not None:
            one = torch.ones(1, dtype=torch.int32, device=device) if one is None else one
            state.counts.index_add_(0, tokens[i:i + 1], one)
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    host = [tokens.double()]
    top = max((params[i].logprobs for i in asked), default=0)
    if asked:
        idx = _to(device, asked, torch.int64)
        logprobs = logits.index_select(0, idx).float().log_softmax(-1)
        host.append(logprobs.gather(-1, tokens[idx][:, None])[:, 0].double())
        if top:
            values, ids = logprobs.topk(top, dim=-1)
            host += [ids.flatten().double(), values.flatten().double()]
    flat = torch.cat(host).tolist()  # the one wait for the device
    n = len(states)
    results: list[tuple[int, TokenLogprob | None]] = [(int(t), None) for t in flat[:n]]
    chosen, top_ids = flat[n:n + len(asked)], flat[n + len(asked):]
    top_values = top_ids[len(asked) * top:]
    for j, i in enumerate(asked):
        k, base = params[i].logprobs, j * top
        alternatives = tuple((int(top_ids[base + a]), top_values[base + a]) for a in range(k))
        results[i] = (results[i][0], TokenLogprob(results[i][0], chosen[j], alternatives))
    return results
