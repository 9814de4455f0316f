"""Helpers shared by the engine tests: building requests and running an engine dry."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ninfer_runtime.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from ninfer_runtime.engine.cuda_graph import StepGraphs
from ninfer_runtime.engine.request import SamplingParams
from ninfer_runtime.models.loading import LoadedModel


def prompt(length: int, seed: int, vocab: int = 1000) -> tuple[int, ...]:
    """Random token ids below the tiny profiles' special tokens (1000+)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (length,), generator=gen).tolist())


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def request(rid: str, ids: Sequence[int], sampling: SamplingParams) -> EngineRequest:
    return EngineRequest(rid, tuple(ids), sampling, arrival_time=time.perf_counter())


class TickingClock:
    """A wall clock that moves one second per call: every engine step (which reads the clock
    at its start and end) gets its own one-second records."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def engine(loaded: LoadedModel, *, generation_config: Mapping[str, object] | None = None,
           wall_clock: Callable[[], float] = time.time, **config: object) -> Engine:
    return Engine(loaded.model, EngineConfig(**config),  # type: ignore[arg-type]
                  tokenizer=loaded.tokenizer, wall_clock=wall_clock,
                  generation_config=(loaded.generation_config if generation_config is None
                                     else generation_config))


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    steps: int = 0

    def finished(self, rid: str) -> RequestOutput:
        last = self.outputs[rid][-1]
        assert last.finished
        return last


def drain(eng: Engine, requests: Sequence[EngineRequest] = (), max_steps: int = 10_000) -> Run:
    """Add `requests`, then step until nothing is unfinished; every output checked for shape."""
    for req in requests:
        eng.add_request(req)
    run = Run()
    while eng.has_unfinished():
        assert run.steps < max_steps, "the engine does not make progress"
        for out in eng.step():
            assert len(out.new_token_ids) == 1
            previous = run.outputs.setdefault(out.request_id, [])
            assert not (previous and previous[-1].finished), "output after finishing"
            previous.append(out)
            run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        run.steps += 1
    return run


def alone(loaded: LoadedModel, requests: Sequence[EngineRequest],
          **config: object) -> dict[str, list[int]]:
    """Each request on its own: one engine at concurrency 1, one request at a time."""
    eng = engine(loaded, **{**config, "max_concurrency": 1})
    out = {}
    for req in requests:
        out.update(drain(eng, [req]).tokens)
    return out


def count_replays(**graphs: StepGraphs) -> Counter[tuple[str, int]]:
    """Counts, by (name, step tokens), the runs of each StepGraphs from now on."""
    replays: Counter[tuple[str, int]] = Counter()
    for name, g in graphs.items():
        g.run = lambda *a, _run=g.run, _name=name: replays.update(  # type: ignore[method-assign]
            [(_name, a[0].num_tokens)]) or _run(*a)
    return replays
