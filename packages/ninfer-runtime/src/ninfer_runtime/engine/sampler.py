"""Per-request sampling over a step's logits rows, and the logprobs callers ask for.

Each request keeps its own `SamplerState`: its parameters, its seed (`seed`, or one drawn from
the OS when there is none), a step counter, and, when a penalty is on, its prompt tokens and
output token counts as device tensors. A step samples every row at once on the logits' device
(ops.sampling.sample_rows): a request's draw depends only on its seed, its step and its logits
row, so its tokens do not depend on what else is in the batch. Nothing waits for the device
until the sampled ids (and the requested logprobs) come back in one copy at the end.
Logprobs are the log_softmax of the raw logits (before penalties and temperature, vLLM's
default "raw" mode).

Speculative decoding verifies drafts with the same draws (`sample_verify`): a request's row
for its output token j is sampled with step j and penalties counting the tokens before it, so
accepting a draft is the event "the plain sampler would have drawn it".
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer_runtime.engine.request import AdmissionError, SamplingParams, TokenLogprob
from ninfer_runtime.ops.host_copy import to_device
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
            state.prompt[to_device(prompt, torch.int64, device)] = True
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


def _penalised(logits: torch.Tensor, states: Sequence[SamplerState],
               drafts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The logits with each penalised row's penalties applied (a copy when any is). Request r
    owns 1 + len(drafts[r]) consecutive rows; its row i counts the output and drafts[r][:i]."""
    rows, row_states, extra_rows, extra_tokens = [], [], [], []
    first = 0
    for state, d in zip(states, drafts, strict=True):
        n = 1 + len(d)
        if state.penalized:
            base = len(rows)
            rows.extend(range(first, first + n))
            row_states.extend([state] * n)
            for i in range(1, n):
                extra_rows.extend([base + i] * i)
                extra_tokens.extend(d[:i])
        first += n
    if not rows:
        return logits
    device = logits.device
    idx = to_device(rows, torch.int64, device)
    rep, freq, pres = to_device([[s.params.repetition_penalty for s in row_states],
                                 [s.params.frequency_penalty for s in row_states],
                                 [s.params.presence_penalty for s in row_states]],
                                torch.float32, device)
    counts = torch.stack([s.counts for s in row_states])
    if extra_rows:
        counts.index_put_((to_device(extra_rows, torch.int64, device),
                           to_device(extra_tokens, torch.int64, device)),
                          torch.ones(len(extra_rows), dtype=counts.dtype, device=device),
                          accumulate=True)
    penalised = apply_penalties(logits.index_select(0, idx),
                                torch.stack([s.prompt for s in row_states]), counts, rep, freq,
                                pres)
    return logits.to(torch.float32, copy=True).index_copy_(0, idx, penalised)


def _row_sampling(row_states: Sequence[SamplerState], offsets: Sequence[int], vocab: int,
                  device: torch.device) -> RowSampling:
    """Row r sampled as its request's output token step + offsets[r]."""
    params = [s.params for s in row_states]
    return RowSampling.build([p.temperature for p in params], [p.top_k for p in params],
                             [p.top_p for p in params], [p.min_p for p in params],
                             [s.seed for s in row_states],
                             [s.step + i for s, i in zip(row_states, offsets, strict=True)],
                             vocab, device)


def defers(state: SamplerState) -> bool:
    """Whether a request's tokens may be sampled without reading them (`sample_deferred`):
    nothing the next step samples depends on them but its step counter (no penalties, which
    count the output) and there are no logprobs to return with them."""
    return not state.penalized and state.params.logprobs is None


def sample_deferred(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """One token per row of logits [R, V], as `sample` draws it, left on the device [R] int64
    (nothing waits); each state's step advances as if its token were read. For requests that
    `defers`, whose next step can then be launched before this one's tokens are known."""
    assert all(defers(s) for s in states), "deferred sampling takes no penalties or logprobs"
    tokens = sample_rows(logits, _row_sampling(states, [0] * len(states), logits.shape[-1],
                                               logits.device))
    for state in states:
        state.step += 1
    return tokens


def sample(logits: torch.Tensor,
           states: Sequence[SamplerState]) -> list[tuple[int, TokenLogprob | None]]:
    """One token (and its logprobs when asked) per row of logits [R, V], row r drawn with
    states[r], whose step and counts it then advances."""
    return [emitted[0] for emitted in sample_verify(logits, states, [()] * len(states))]


def sample_verify(logits: torch.Tensor, states: Sequence[SamplerState],
                  drafts: Sequence[Sequence[int]],
                  ) -> list[list[tuple[int, TokenLogprob | None]]]:
    """Speculative verification: the tokens (and logprobs) each request emits this step.

    Request r owns 1 + len(drafts[r]) consecutive rows of logits [R, V]; its row i is the
    target's prediction of output token step + i, given the output so far and drafts[r][:i].
    Every row is sampled as the plain sampler samples that token (penalties counting the
    output and the drafts before it, the same temperature and filters, the noise of (seed,
    step + i)), and the request emits its rows' tokens up to the first that differs from its
    draft: the accepted drafts, then the target's own token (the correction, or the bonus when
    every draft is accepted). States advance by the emitted tokens.

    This is the lossless rule for deterministic drafts (specdecode.md D.1): a draft d is
    accepted with probability p(d), the chance that the row's sample is d, and on rejection
    the emitted token is the sample conditioned on not being d, i.e. a draw from p without d,
    renormalised. Each emitted token is a draw from the target's distribution given the true
    prefix, and since its noise is keyed by its output index exactly as in plain decoding, a
    seed gives the same tokens with or without speculation (up to the logits' rounding).
    Greedy rows accept while the draft is the argmax.
    """
    device = logits.device
    row_states = [s for s, d in zip(states, drafts, strict=True) for _ in range(1 + len(d))]
    offsets = [i for d in drafts for i in range(1 + len(d))]
    params = [s.params for s in row_states]
    tokens = sample_rows(_penalised(logits, states, drafts),
                         _row_sampling(row_states, offsets, logits.shape[-1], device))
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    host = [tokens.double()]
    top = max((params[i].logprobs for i in asked), default=0)
    if asked:
        idx = to_device(asked, torch.int64, device)
        logprobs = logits.index_select(0, idx).float().log_softmax(-1)
        host.append(logprobs.gather(-1, tokens[idx][:, None])[:, 0].double())
        if top:
            values, ids = logprobs.topk(top, dim=-1)
            host += [ids.flatten().double(), values.flatten().double()]
    flat = torch.cat(host).tolist()  # the one wait for the device
    n = len(row_states)
    sampled = [int(t) for t in flat[:n]]
    chosen, top_ids = flat[n:n + len(asked)], flat[n + len(asked):]
    top_values = top_ids[len(asked) * top:]
    row_logprobs: dict[int, TokenLogprob] = {}
    for j, i in enumerate(asked):
        k, base = params[i].logprobs, j * top
        alternatives = tuple((int(top_ids[base + a]), top_values[base + a]) for a in range(k))
        row_logprobs[i] = TokenLogprob(sampled[i], chosen[j], alternatives)
    results = []
    first = 0
    for state, d in zip(states, drafts, strict=True):
        accepted = 0
        while accepted < len(d) and sampled[first + accepted] == d[accepted]:
            accepted += 1
        emitted = range(first, first + accepted + 1)
        results.append([(sampled[r], row_logprobs.get(r)) for r in emitted])
        state.step += len(emitted)
        if state.counts is not None:
            ids = to_device([sampled[r] for r in emitted], torch.int64, device)
            state.counts.index_add_(0, ids, torch.ones_like(ids, dtype=state.counts.dtype))
        first += 1 + len(d)
    return results
