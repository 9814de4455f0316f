"""The engine: continuous batching of requests over one model, one step at a time.

Synchronous and single-threaded (not thread-safe): the caller (the server's engine thread, or
`LLM.generate`) adds and aborts requests and calls `step()` while `has_unfinished()`. A step
admits what fits (scheduler), builds one StepBatch of every running request's decode token or
prompt chunk, runs one forward over it, samples the rows that end a prompt or decode, and
returns a RequestOutput per request that got a token.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ninfer_runtime.config import ModelConfig
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.device_setup import decode_graphs, plan_device_memory
from ninfer_runtime.engine.kv_pool import KVPool, resolve_kv_capacity
from ninfer_runtime.engine.request import (
    AdmissionError,
    EngineRequest,
    FinishReason,
    RequestOutput,
    TokenLogprob,
)
from ninfer_runtime.engine.request_state import RequestState
from ninfer_runtime.engine.sampler import SamplerState, check_sampling, sample
from ninfer_runtime.engine.scheduler import Schedule, Scheduler
from ninfer_runtime.engine.state_pool import StatePool
from ninfer_runtime.engine.stats import IntervalRecorder, StepRecord
from ninfer_runtime.models.cache import GDNSlots, PagedKV
from ninfer_runtime.models.loading import load_artifact
from ninfer_runtime.models.qwen3_5 import Qwen3_5Model

if TYPE_CHECKING:
    from ninfer_runtime.tokenizer import Tokenizer


def eos_token_ids(generation_config: Mapping[str, Any], cfg: ModelConfig) -> frozenset[int]:
    """The generation config's eos ids and the model config's."""
    eos = generation_config.get("eos_token_id")
    ids: Iterable[int] = () if eos is None else ([eos] if isinstance(eos, int) else eos)
    return frozenset(ids) | frozenset(cfg.eos_token_ids)


class Engine:
    """`Engine.from_artifact(path, config)` loads a model on config.device; `Engine(model,
    config)` serves a model already loaded (it runs on the model's device)."""

    def __init__(self, model: Qwen3_5Model, config: EngineConfig, *,
                 tokenizer: Tokenizer | None = None,
                 generation_config: Mapping[str, Any] | None = None,
                 wall_clock: Callable[[], float] = time.time):
        self.model = model
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.generation_config = dict(generation_config or {})
        self.eos_token_ids = eos_token_ids(self.generation_config, model.config)
        on_gpu = model.device.type == "cuda"
        self.memory_plan = plan_device_memory(model, config) if on_gpu else None
        capacity = (self.memory_plan.kv_capacity if self.memory_plan is not None
                    else resolve_kv_capacity(config, model.config, model.dtype, model.device))
        self.config = replace(config, kv_capacity=capacity, device=str(model.device),
                              cuda_graphs=config.cuda_graphs and on_gpu)
        self.caches = model.allocate_cache(capacity // config.page_size, config.page_size,
                                           config.max_concurrency, config.kv_dtype == "int8")
        self.graphs = decode_graphs(model, self.caches, self.config) if self.config.cuda_graphs \
            else None
        self.kv_pool = KVPool([c for c in self.caches if isinstance(c, PagedKV)])
        self.state_pool = StatePool([c for c in self.caches if isinstance(c, GDNSlots)])
        self.scheduler = Scheduler(config.max_concurrency, config.max_context,
                                   config.prefill_chunk, self.kv_pool, self.state_pool)
        self._intervals = IntervalRecorder()
        self._wall_clock = wall_clock

    @classmethod
    def from_artifact(cls, path: str | Path, config: EngineConfig) -> Engine:
        loaded = load_artifact(path, config.device)
        return cls(loaded.model, config, tokenizer=loaded.tokenizer,
                   generation_config=loaded.generation_config)

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
        wall_start, start = self._wall_clock(), time.perf_counter()
        schedule = self.scheduler.schedule()
        if not schedule.work:
            return []
        for state in schedule.admitted:
            state.first_scheduled = start
            state.stats.queue_seconds = start - state.request.arrival_time
        batch = self._build(schedule)
        prepared = time.perf_counter()
        for state in schedule.admitted:
            state.stats.prepare_seconds = prepared - start
        sampled = [w for w in schedule.work if w.samples]
        results = []
        if self.graphs is not None and self.graphs.can_run(batch):
            _, logits = self.graphs.run(batch)
        else:
            hidden = self.model.forward_batch(batch, self.caches)
            logits = self.model.logits(hidden[batch.logits_rows]) if sampled else None
        if sampled:
            assert logits is not None
            results = sample(logits, [w.state.sampler for w in sampled])
        now = time.perf_counter()
        prefill_tokens = 0
        for w in schedule.work:
            w.state.num_computed += len(w.token_ids)
            if w.prefill:
                w.state.stats.computed_prefill_tokens += len(w.token_ids)
                prefill_tokens += len(w.token_ids)
        outputs = [self._commit(w.state, token, logprob, now)
                   for w, (token, logprob) in zip(sampled, results, strict=True)]
        self._intervals.record(StepRecord(
            wall_start, self._wall_clock(), prefill_tokens, len(outputs),
            running=len(schedule.work), prefilling=schedule.prefilling,
            decode_ready=schedule.decode_ready))
        return outputs

    # ---- internals ----

    def _build(self, schedule: Schedule) -> StepBatch:
        segments = []
        for w in schedule.work:
            assert w.state.slot is not None
            segments.append(Segment(w.token_ids, w.start, w.state.pages, w.state.slot,
                                    "last" if w.samples else "none"))
        return StepBatch.build(segments, self.config.page_size, self.model.device)

    def _commit(self, state: RequestState, token: int, logprob: TokenLogprob | None,
                now: float) -> RequestOutput:
        """Append a sampled token, update the stats, finish the request if it is done."""
        state.output.append(token)
        stats = state.stats
        stats.completion_tokens += 1
        if state.first_token is None:
            assert state.first_scheduled is not None
            state.first_token = now
            stats.prefill_seconds = now - state.first_scheduled
        stats.decode_seconds = now - state.first_token
        reason = self._finish_reason(state, token)
        if reason is not None:
            self.scheduler.finish(state.request_id)
        return RequestOutput(state.request_id, (token,),
                             None if logprob is None else (logprob,), reason is not None, reason,
                             copy.deepcopy(stats))

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
