"""The engine: continuous batching of requests over one model, one step at a time.

Synchronous and single-threaded (not thread-safe): the caller (the server's engine thread, or
`LLM.generate`) adds and aborts requests and calls `step()` while `has_unfinished()`. A step
admits what fits (scheduler), builds one StepBatch of every running request's decode token or
prompt chunk, runs one forward over it, samples the rows that end a prompt or decode, and
returns a RequestOutput per request that got tokens.

With speculative decoding (config.spec) every decode step is a verify step: a decode-ready
request's segment is its last sampled token followed by the K drafts its proposer made at the
end of the previous step, at positions P..P+K. Sampling accepts a prefix of the drafts and adds
one token of the target's own (engine.sampler.sample_verify, lossless); the GDN state rolls
back to the last accepted position by an exchange of state slots (engine.spec.rollback); the
proposer then takes in the committed rows and drafts again. A step may so emit up to K+1
tokens per request, scanned in order for stop tokens and max_tokens.

Overlapped decode (config.overlap_decode): reading a step's sampled ids waits for the device,
and everything the host does between two steps (scheduling, building the batch, launching,
committing the tokens) would leave the device idle. So a plain decode step (no prompt chunk,
no drafts, no penalties or logprobs) is launched and sampled without being read: its ids stay
on the device and are copied back behind it (`_Deferred`). The next step, when it advances
the same requests, takes those device ids as its input tokens, is launched, and only then are
the previous step's tokens read and committed, while the device computes. The engine returns
each token one step() later; a request that a token finishes (a stop token) has had one more
step computed, which is dropped, its pages and slot already free (later kernels use them only
after it, in stream order). Anything else (a request that can be admitted, one that ends at
max_tokens, an abort, a prompt chunk) reads the deferred step first and the step runs as
above; requests queued behind a full engine do not stop the overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ninfer_runtime.artifact import Artifact
from ninfer_runtime.config import ModelConfig
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.device_setup import (
    device_warmup_steps,
    plan_device_memory,
    step_graphs,
    warm_up_proposer,
)
from ninfer_runtime.engine.kv_pool import KVPool, request_pages, resolve_kv_capacity
from ninfer_runtime.engine.request import (
    AdmissionError,
    EngineRequest,
    FinishReason,
    RequestOutput,
    TokenLogprob,
)
from ninfer_runtime.engine.request_state import RequestState
from ninfer_runtime.engine.sampler import (
    SamplerState,
    check_sampling,
    defers,
    sample_deferred,
    sample_verify,
)
from ninfer_runtime.engine.scheduler import Scheduler, Work
from ninfer_runtime.engine.spec import Committed, Proposer, make_proposer
from ninfer_runtime.engine.spec.rollback import keep_state_after, snapshot_slots
from ninfer_runtime.engine.state_pool import StatePool
from ninfer_runtime.engine.stats import IntervalRecorder, StepRecord
from ninfer_runtime.models.cache import GDNSlots, PagedKV
from ninfer_runtime.models.loading import load_artifact
from ninfer_runtime.models.qwen3_5 import Qwen3_5Model
from ninfer_runtime.ops.dispatch import ops_mode

if TYPE_CHECKING:
    from ninfer_runtime.tokenizer import Tokenizer


def eos_token_ids(generation_config: Mapping[str, Any], cfg: ModelConfig) -> frozenset[int]:
    """The generation config's eos ids and the model config's."""
    eos = generation_config.get("eos_token_id")
    ids: Iterable[int] = () if eos is None else ([eos] if isinstance(eos, int) else eos)
    return frozenset(ids) | frozenset(cfg.eos_token_ids)


def check_context(max_context: int, cfg: ModelConfig) -> None:
    """Refuse a context longer than the model's positions (`ModelConfig.context_limit`): past
    them RoPE rotates keys by angles the model never saw, and its output degrades without an
    error (vLLM refuses such a max_model_len too)."""
    if max_context > cfg.context_limit:
        how = ("its RoPE scaling's original context times the factor" if cfg.rope_scaling
               else "max_position_embeddings; YaRN rope scaling in the model's config extends "
               "it, as the model card describes")
        raise ValueError(f"max context {max_context:,} exceeds the {cfg.context_limit:,} "
                         f"positions the model is made for ({how})")


@dataclass(frozen=True, slots=True)
class _Deferred:
    """A launched plain decode step whose sampled ids are not read yet."""

    work: list[Work]
    tokens: torch.Tensor  # [B] int64 on the device: the next step's input ids
    host: torch.Tensor  # [B] int64 on the host (pinned), complete once `ready` is
    ready: torch.cuda.Event | None  # None on a CPU, where `host` is complete at once
    wall_start: float


def _to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A copy of the device's ids on its way to the host, queued behind the step."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class Engine:
    """`Engine.from_artifact(path, config)` loads a model on config.device; `Engine(model,
    config)` serves a model already loaded (it runs on the model's device). With config.spec,
    `proposer` drafts the tokens (`make_proposer(config, loaded.drafts, loaded.model)`, as
    from_artifact does, or any other `Proposer`)."""

    def __init__(self, model: Qwen3_5Model, config: EngineConfig, *,
                 tokenizer: Tokenizer | None = None,
                 generation_config: Mapping[str, Any] | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 proposer: Proposer | None = None):
        if (proposer is None) != (config.spec == "none"):
            raise ValueError(f"spec {config.spec!r} with {'no' if proposer is None else 'a'} "
                             f"proposer: spec decoding needs one (Engine.from_artifact builds "
                             f"it), plain decoding none")
        if proposer is not None and proposer.num_drafts != config.draft_tokens:
            raise ValueError(f"the proposer drafts {proposer.num_drafts} tokens, the config "
                             f"{config.draft_tokens}")
        check_context(config.max_context, model.config)
        self.model = model
        self.proposer = proposer
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.generation_config = dict(generation_config or {})
        self.eos_token_ids = eos_token_ids(self.generation_config, model.config)
        on_gpu = model.device.type == "cuda"
        draft_kv = proposer.cache_bytes_per_token(config.kv_dtype == "int8") if proposer else 0
        self.memory_plan = plan_device_memory(model, config, draft_kv) if on_gpu else None
        capacity = (self.memory_plan.kv_capacity if self.memory_plan is not None
                    else resolve_kv_capacity(config, model.config, model.dtype, model.device))
        # the torch references read tensors on the host (cu_seqlens.tolist()), which graph
        # capture forbids: NINFER_OPS=ref, the oracle, runs its steps eagerly
        self.config = replace(config, kv_capacity=capacity, device=str(model.device),
                              cuda_graphs=config.cuda_graphs and on_gpu and ops_mode() != "ref")
        num_pages, int8_kv = capacity // config.page_size, config.kv_dtype == "int8"
        # a speculative request holds K extra GDN state slots (engine.spec.rollback)
        self.caches = model.allocate_cache(num_pages, config.page_size,
                                           config.max_concurrency * (1 + config.spec_tokens),
                                           int8_kv)
        if proposer is not None:  # its caches use the target's page ids
            proposer.allocate(num_pages, config.page_size, int8_kv)
            if on_gpu:  # the target warmed up while planning the memory
                warm_up_proposer(proposer, model, self.config,
                                 device_warmup_steps(model, self.config), num_pages)
            if self.config.cuda_graphs:
                proposer.capture_graphs(config.max_concurrency, request_pages(config))
        self.graphs = step_graphs(model, self.caches, self.config,
                                  proposer.taps if proposer else ()) \
            if self.config.cuda_graphs else None
        self.kv_pool = KVPool([c for c in self.caches if isinstance(c, PagedKV)])
        self.state_pool = StatePool([c for c in self.caches if isinstance(c, GDNSlots)])
        self.scheduler = Scheduler(config.max_concurrency, config.max_context,
                                   config.prefill_chunk, self.kv_pool, self.state_pool,
                                   config.spec_tokens, config.step_tokens)
        self._intervals = IntervalRecorder()
        self._wall_clock = wall_clock
        self._deferred: _Deferred | None = None  # overlapped decode (module docstring)

    @classmethod
    def from_artifact(cls, path: str | Path, config: EngineConfig) -> Engine:
        artifact = Artifact.open(path, verify=False)
        # before the checksums and the weights: a 27B's take a while to be refused after
        check_context(config.max_context, artifact.config)
        artifact.verify()
        loaded = load_artifact(artifact, config.device, mtp=config.spec == "mtp",
                               dflash=config.spec == "dflash",
                               lm_head_draft=config.lm_head_draft)
        return cls(loaded.model, config, tokenizer=loaded.tokenizer,
                   generation_config=loaded.generation_config,
                   proposer=make_proposer(config, loaded.drafts, loaded.model))

    # ---- the contract ----

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; AdmissionError if it is invalid or can never fit."""
        vocab = self.model_config.vocab_size
        if not req.prompt_token_ids:
            raise AdmissionError("the prompt is empty")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise AdmissionError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {vocab})")
        check_sampling(req.sampling, vocab)
        sampler = SamplerState.create(req.sampling, req.prompt_token_ids, vocab,
                                      self.model.device)
        state = RequestState(req, sampler)
        state.stats.prompt_tokens = len(req.prompt_token_ids)
        self.scheduler.add(state)

    def abort_request(self, request_id: str) -> None:
        """Forget a request now (its pages and slot are free on return); unknown ids are
        ignored, so aborting a request that just finished is harmless."""
        self.scheduler.finish(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def queue_depth(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def intervals(self, since: float | None = None) -> list[dict]:
        """The complete one-second records starting at or after `since` (engine.stats)."""
        return self._intervals.complete(self._wall_clock(), since)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return self._step()
        if self._continues(deferred):
            self._deferred = self._launch([Work(w.state, [0], w.state.num_computed)
                                           for w in deferred.work], deferred.tokens)
            outputs = self._read(deferred)
            if not any(self._running(w.state) for w in self._deferred.work):
                self._deferred = None  # every request finished: nothing left to read
            return outputs
        return self._read(deferred) + self._step()

    # ---- internals ----

    def _step(self) -> list[RequestOutput]:
        wall_start, start = self._wall_clock(), time.perf_counter()
        schedule = self.scheduler.schedule()
        if not schedule.work:
            return []
        running = len(self.scheduler.running)  # some may wait out a step for its token budget
        for state in schedule.admitted:
            state.first_scheduled = start
            state.stats.queue_seconds = start - state.request.arrival_time
        work = list(schedule.work)  # decode segments first (scheduler.Schedule)
        if self._defers(work):
            self._deferred = self._launch(work, None, wall_start)
            return []
        batch = self._build(work)
        prepared = time.perf_counter()
        for state in schedule.admitted:
            state.stats.prepare_seconds = prepared - start
        sampled = [w for w in work if w.samples]
        hidden, logits, taps = self._forward(batch)
        results = []
        if sampled:
            assert logits is not None
            results = sample_verify(logits, [w.state.sampler for w in sampled],
                                    [w.drafts for w in sampled])
        now = time.perf_counter()
        emitted = {w.state.request_id: tokens for w, tokens in zip(sampled, results, strict=True)}
        prefill_tokens = 0
        for w in work:
            if w.prefill:
                w.state.num_computed += len(w.token_ids)
                w.state.stats.computed_prefill_tokens += len(w.token_ids)
                prefill_tokens += len(w.token_ids)
            else:
                self._accept(w, len(emitted[w.state.request_id]) - 1)
        outputs = [self._commit(w.state, emitted[w.state.request_id], now) for w in sampled]
        if self.proposer is not None:
            self._propose(work, hidden, taps)
        self._intervals.record(StepRecord(
            wall_start, self._wall_clock(), prefill_tokens,
            sum(len(o.new_token_ids) for o in outputs), len(outputs), running=running,
            prefilling=schedule.prefilling, decode_ready=schedule.decode_ready))
        return outputs

    def _defers(self, work: list[Work]) -> bool:
        """Whether this step's tokens may be read one step later: plain decode rows only."""
        return (self.config.overlap_decode and self.proposer is None
                and all(not w.prefill and defers(w.state.sampler) for w in work))

    def _continues(self, deferred: _Deferred) -> bool:
        """Whether the next step may be launched before `deferred` is read: it would advance
        exactly the same requests (none to admit now, none aborted), and none of them ends
        at max_tokens with the deferred token."""
        states = [w.state for w in deferred.work]
        running = list(self.scheduler.running.values())
        return (not self.scheduler.can_admit() and len(running) == len(states)
                and all(a is b for a, b in zip(running, states, strict=True))
                and all(len(s.output) + 1 < s.request.sampling.max_tokens for s in states))

    def _launch(self, work: list[Work], inputs: torch.Tensor | None,
                wall_start: float | None = None) -> _Deferred:
        """Run and sample a plain decode step without reading its tokens. `inputs`: the
        device ids the step takes instead of its work's token ids (the previous deferred
        step's samples, not yet on the host)."""
        wall_start = self._wall_clock() if wall_start is None else wall_start
        batch = self._build(work)
        if inputs is not None:
            batch.token_ids.copy_(inputs)
        _, logits, _ = self._forward(batch)
        assert logits is not None
        tokens = sample_deferred(logits, [w.state.sampler for w in work])
        for w in work:
            w.state.num_computed += 1
        return _Deferred(work, tokens, *_to_host(tokens), wall_start)

    def _read(self, deferred: _Deferred) -> list[RequestOutput]:
        """Commit a deferred step's tokens (waiting for them) to the requests still running."""
        if deferred.ready is not None:
            deferred.ready.synchronize()
        now = time.perf_counter()
        outputs = [self._commit(w.state, [(token, None)], now)
                   for w, token in zip(deferred.work, deferred.host.tolist(), strict=True)
                   if self._running(w.state)]
        self._intervals.record(StepRecord(
            deferred.wall_start, self._wall_clock(), 0, len(outputs), len(outputs),
            running=len(deferred.work), prefilling=0, decode_ready=len(deferred.work)))
        return outputs

    def _running(self, state: RequestState) -> bool:
        return self.scheduler.running.get(state.request_id) is state

    def _build(self, work: list[Work]) -> StepBatch:
        segments = []
        for w in work:
            assert w.state.slot is not None
            verify = self.proposer is not None and not w.prefill
            segments.append(Segment(
                w.token_ids, w.start, w.state.pages, w.state.slot,
                "all" if not w.prefill else "last" if w.samples else "none",
                snapshot_slots(w.state, len(w.token_ids)) if verify else None))
        return StepBatch.build(segments, self.config.page_size, self.model.device)

    def _forward(self, batch: StepBatch
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The target forward of one step: the final-normed hidden of every row [N, H], fp32
        logits of batch.logits_rows (None when there are none), and the taps the proposer
        reads (None when it reads none). A step a captured CUDA graph covers replays it."""
        taps = self.proposer.taps if self.proposer is not None else ()
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden, logits, *tapped = self.graphs.run(batch)
            return hidden, logits, tapped[0] if taps else None
        hidden, tapped = self.model.forward_taps(batch, self.caches, taps)
        logits = self.model.logits(batch.logits_hidden(hidden)) \
            if batch.logits_rows.shape[0] else None
        return hidden, logits, tapped if taps else None

    def _accept(self, w: Work, accepted: int) -> None:
        """A decode step's outcome: `accepted` of its drafts (and the token before them) are
        now computed; the GDN state after the last of them becomes current."""
        state = w.state
        state.num_computed += accepted + 1
        drafts = len(w.drafts)
        if not drafts:
            return
        keep_state_after(state, accepted, len(w.token_ids))
        spec = state.stats.spec
        spec.rounds += 1
        spec.drafted_tokens += drafts
        spec.accepted_tokens += accepted
        if len(spec.accepted_per_position) < drafts:
            spec.accepted_per_position.extend([0] * (drafts - len(spec.accepted_per_position)))
        for i in range(accepted):
            spec.accepted_per_position[i] += 1

    def _propose(self, work: list[Work], hidden: torch.Tensor,
                 taps: torch.Tensor | None) -> None:
        """Tell the proposer what this step committed; store the drafts it returns."""
        assert self.proposer is not None
        committed, states, first = [], [], 0
        for w in work:
            state = w.state
            rows = len(w.token_ids) if w.prefill else state.num_computed - w.start
            if state.request_id in self.scheduler.running:
                committed.append(Committed(
                    state.request_id, range(first, first + rows), w.start,
                    state.token_ids(w.start + 1, w.start + 1 + rows), state.pages,
                    propose=not state.prefilling))
                states.append(state)
            first += len(w.token_ids)
        for state, drafts in zip(states, self.proposer.propose(hidden, taps, committed),
                                 strict=True):
            state.drafts = drafts

    def _commit(self, state: RequestState, tokens: list[tuple[int, TokenLogprob | None]],
                now: float) -> RequestOutput:
        """Append the emitted tokens in order up to the first that finishes the request (a
        stop token, or max_tokens), update the stats, finish the request if it is done."""
        new: list[tuple[int, TokenLogprob | None]] = []
        reason = None
        for token, logprob in tokens:
            state.output.append(token)
            new.append((token, logprob))
            reason = self._finish_reason(state, token)
            if reason is not None:
                break
        stats = state.stats
        stats.completion_tokens += len(new)
        if state.first_token is None:
            assert state.first_scheduled is not None
            state.first_token = now
            stats.prefill_seconds = now - state.first_scheduled
        stats.decode_seconds = now - state.first_token
        if reason is not None:
            self.scheduler.finish(state.request_id)
        logprobs = None if new[0][1] is None else tuple(lp for _, lp in new if lp is not None)
        return RequestOutput(state.request_id, tuple(t for t, _ in new), logprobs,
                             reason is not None, reason, stats.snapshot())

    def _finish_reason(self, state: RequestState, token: int) -> FinishReason | None:
        """"stop" on a stop token (eos unless ignore_eos), "length" at max_tokens. Admission
        guarantees prompt + max_tokens <= max_context, so max_context is reached only there."""
        sampling = state.request.sampling
        if token in sampling.stop_token_ids or (not sampling.ignore_eos
                                                and token in self.eos_token_ids):
            return "stop"
        if len(state.output) >= sampling.max_tokens:
            return "length"
        return None
