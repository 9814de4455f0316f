"""Which requests run, and what each computes, at every step. Pure Python: no tensors.

Admission is by memory and strictly first come, first served: the request at the head of the
queue starts once a state slot is free and the KV pool can reserve every page it may ever need
(prompt + max_tokens, + K with speculative decoding, whose verify steps write K/V up to K
positions ahead; such a request also takes K extra state slots, for rollback); later requests
wait behind it. Because the pages are reserved up front a
running request never runs out of KV memory, so there is no preemption and no recomputation. A
request that could not fit even in an empty engine is refused when it is added.

Each step advances the running requests: every decode-ready one by its last sampled token (and
its drafts), then the prefilling ones, in admission order, by their next prompt chunk of at
most `prefill_chunk` tokens while the step's budget of `step_tokens` lasts (vLLM's
max_num_batched_tokens); requests are admitted only while some of it is left. Both kinds go
into one forward. The budget bounds a step's activations whatever the concurrency, and lets
one long prompt take a large chunk when it prefills alone. Since it holds at least a decode
token for every request, the first prefilling request always gets one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ninfer_runtime.engine.kv_pool import KVPool
from ninfer_runtime.engine.request import AdmissionError
from ninfer_runtime.engine.request_state import RequestState
from ninfer_runtime.engine.state_pool import StatePool


@dataclass(frozen=True, slots=True)
class Work:
    """One running request's share of a step."""

    state: RequestState
    token_ids: list[int]
    start: int  # position of the first token

    @property
    def prefill(self) -> bool:
        """Whether these are prompt tokens (a chunk) rather than a decode token."""
        return self.start < self.state.prompt_len

    @property
    def samples(self) -> bool:
        """Whether this step ends with a new token for the request (its logits are needed)."""
        return self.start + len(self.token_ids) >= self.state.prompt_len

    @property
    def drafts(self) -> list[int]:
        """The draft tokens this step verifies (after the last sampled token)."""
        return [] if self.prefill else self.token_ids[1:]


@dataclass(frozen=True, slots=True)
class Schedule:
    # decode (verify) segments first, then prompt chunks: a step's leading segments take the
    # GDN's recurrent path (engine.batch)
    work: tuple[Work, ...]
    admitted: tuple[RequestState, ...]  # requests whose first step this is

    @property
    def prefilling(self) -> int:
        return sum(w.prefill for w in self.work)

    @property
    def decode_ready(self) -> int:
        return len(self.work) - self.prefilling


class Scheduler:
    def __init__(self, max_concurrency: int, max_context: int, prefill_chunk: int,
                 kv: KVPool, states: StatePool, spec_tokens: int, step_tokens: int):
        """step_tokens: the step's budget (EngineConfig.step_tokens, which checked that it
        holds a decode step of max_concurrency requests)."""
        self.max_concurrency = max_concurrency
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.step_tokens = step_tokens
        self.kv = kv
        self.states = states
        self.spec_tokens = spec_tokens  # K: extra KV positions and state slots per request
        self.waiting: deque[RequestState] = deque()
        self.running: dict[str, RequestState] = {}  # in admission order

    def add(self, state: RequestState) -> None:
        """Queue a request; AdmissionError if it can never run."""
        rid = state.request_id
        if rid in self.running or any(w.request_id == rid for w in self.waiting):
            raise AdmissionError(f"request id {rid!r} is already in use")
        if state.max_len > self.max_context:
            raise AdmissionError(f"prompt ({state.prompt_len} tokens) + max_tokens "
                                 f"({state.request.sampling.max_tokens}) exceeds the maximum "
                                 f"context of {self.max_context} tokens")
        if self.kv.pages_for(self._reserved(state)) > self.kv.num_pages:
            drafts = f" + {self.spec_tokens} draft tokens" if self.spec_tokens else ""
            raise AdmissionError(f"prompt + max_tokens ({state.max_len} tokens){drafts} "
                                 f"exceeds the KV pool of {self.kv.capacity} tokens")
        self.waiting.append(state)

    def schedule(self) -> Schedule:
        """Plan one step: the decode-ready requests, the prefilling ones' chunks, then the
        requests admitted while memory and the step's budget allow."""
        ready = [s for s in self.running.values() if not s.prefilling]
        work = [Work(s, s.next_tokens(self.prefill_chunk), s.num_computed) for s in ready]
        left = self.step_tokens - sum(len(w.token_ids) for w in work)

        def chunk(state: RequestState) -> None:
            nonlocal left
            tokens = state.next_tokens(min(self.prefill_chunk, left))
            work.append(Work(state, tokens, state.num_computed))
            left -= len(tokens)

        for state in self.running.values():
            if state.prefilling and left > 0:
                chunk(state)
        admitted = []
        while left > 0 and self.can_admit():
            state = self._admit()
            admitted.append(state)
            chunk(state)
        return Schedule(tuple(work), tuple(admitted))

    def _admit(self) -> RequestState:
        """The head of the queue, its pages reserved and its slots taken."""
        state = self.waiting.popleft()
        state.pages = self.kv.reserve(self._reserved(state))
        state.slot = self.states.allocate()
        # snapshots are written before they are read: no zeroing
        state.extra_slots = [self.states.allocator.allocate() for _ in range(self.spec_tokens)]
        self.running[state.request_id] = state
        return state

    def can_admit(self) -> bool:
        """Whether the request at the head of the queue would start at the next step."""
        return bool(self.waiting and len(self.running) < self.max_concurrency
                    and self.states.allocator.num_free > self.spec_tokens
                    and self.kv.can_reserve(self._reserved(self.waiting[0])))

    def finish(self, request_id: str) -> RequestState | None:
        """Drop a request, waiting or running, freeing its pages and slot at once. Returns it,
        or None for an unknown (or already finished) id."""
        state = self.running.pop(request_id, None)
        if state is None:
            for queued in self.waiting:
                if queued.request_id == request_id:
                    self.waiting.remove(queued)
                    return queued
            return None
        self.kv.release(state.pages)
        assert state.slot is not None
        for slot in (state.slot, *state.extra_slots):
            self.states.release(slot)
        state.pages, state.slot, state.extra_slots = [], None, []
        return state

    def _reserved(self, state: RequestState) -> int:
        """KV positions reserved for a request: every token it may hold, and the positions a
        verify step writes beyond its last one."""
        return state.max_len + self.spec_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
