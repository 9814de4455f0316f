"""Overlapped decode (engine module docstring): a plain decode step is launched before the
previous one's tokens are read; what the requests get must not change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import drain, engine, greedy, prompt, request

from ninfer_runtime.engine import Engine, SamplingParams
from ninfer_runtime.models.loading import LoadedModel, load_artifact

ModelFactory = Callable[[str], LoadedModel]
SMALL = {"max_context": 96, "page_size": 16, "prefill_chunk": 16}


def workload() -> list:
    """Greedy, seeded and penalised requests of mixed lengths and budgets."""
    return [request("greedy", prompt(9, 1), greedy(12)),
            request("seeded", prompt(30, 2), SamplingParams(
                temperature=0.9, top_k=20, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True)),
            request("short", prompt(3, 3), greedy(2)),
            request("one", prompt(5, 4), greedy(1)),
            request("penalised", prompt(7, 5), SamplingParams(
                temperature=0.0, repetition_penalty=1.3, max_tokens=6, ignore_eos=True))]


def tokens_of(loaded: LoadedModel, overlap: bool, requests: list, **config: object) -> dict:
    eng = engine(loaded, overlap_decode=overlap, **SMALL | config)  # type: ignore[arg-type]
    run = drain(eng, requests)
    return {rid: (run.tokens[rid], run.finished(rid).finish_reason) for rid in run.tokens}


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_overlap_on_equals_off(tiny_model: ModelFactory, kind: str, concurrency: int) -> None:
    """Same tokens and finish reasons, whether requests run together, queue (concurrency 1
    and 3: admissions read the deferred step first) or mix with penalised ones (which never
    defer)."""
    loaded = tiny_model(kind)
    on = tokens_of(loaded, True, workload(), max_concurrency=concurrency)
    assert on == tokens_of(loaded, False, workload(), max_concurrency=concurrency)
    assert len(on["greedy"][0]) == 12 and on["one"] == (on["one"][0], "length")


def _trace(eng: Engine) -> list[str]:
    """The order of the engine's forwards and reads of deferred steps, recorded as they run."""
    events: list[str] = []
    forward, read = eng._forward, eng._read

    def traced_forward(batch):  # noqa: ANN001, ANN202
        events.append("forward")
        return forward(batch)

    def traced_read(deferred):  # noqa: ANN001, ANN202
        events.append("read")
        return read(deferred)

    eng._forward, eng._read = traced_forward, traced_read  # type: ignore[method-assign]
    return events


def test_the_next_step_is_launched_before_the_tokens_are_read(
        tiny_model: ModelFactory) -> None:
    """Prefill (read at once), then each decode step's forward comes before the read of the
    step before it; every token still arrives, one step() later."""
    eng = engine(tiny_model("dense"), **SMALL)
    events = _trace(eng)
    run = drain(eng, [request("a", prompt(5, 1), greedy(5))])
    assert len(run.tokens["a"]) == 5
    # 1 prefill (token 1), deferred decode steps for tokens 2..5; the last one is read
    # without launching another, since max_tokens ends the request with its token
    assert events == ["forward", "forward", "forward", "read", "forward", "read", "forward",
                      "read", "read"]
    off = engine(tiny_model("dense"), overlap_decode=False, **SMALL)
    assert drain(off, [request("a", prompt(5, 1), greedy(5))]).steps == run.steps - 1
    # a request queued behind a full engine does not stop the overlap
    full = engine(tiny_model("dense"), max_concurrency=1, **SMALL)
    events = _trace(full)
    queued = drain(full, [request("a", prompt(5, 1), greedy(5)),
                          request("b", prompt(4, 2), greedy(5))])
    assert queued.tokens["a"] == run.tokens["a"] and len(queued.tokens["b"]) == 5
    assert events[:4] == ["forward", "forward", "forward", "read"]


def test_a_stop_token_drops_the_step_computed_after_it(tiny_model: ModelFactory) -> None:
    """A request stopped by a token of a deferred step got one more step launched; its result
    is dropped, and the request beside it is unaffected."""
    loaded = tiny_model("dense")
    ids = prompt(9, 1)
    plain = tokens_of(loaded, False, [request("a", ids, greedy(8))])["a"][0]
    stop = plain[3]  # the 4th token: sampled by a deferred step
    first = plain.index(stop)
    requests = [request("a", ids, SamplingParams(temperature=0.0, max_tokens=8,
                                                 stop_token_ids=(stop,))),
                request("b", prompt(20, 2), greedy(10))]
    on = tokens_of(loaded, True, requests, max_concurrency=2)
    assert on["a"] == (plain[:first + 1], "stop")
    assert on == tokens_of(loaded, False, requests, max_concurrency=2)


def test_abort_while_a_step_is_deferred(tiny_model: ModelFactory) -> None:
    """An abort between steps: the aborted request gets nothing more, the other the same
    tokens as alone, and every page and slot comes back."""
    loaded = tiny_model("dense")
    eng = engine(loaded, max_concurrency=2, **SMALL)
    pages, slots = eng.kv_pool.num_pages, eng.state_pool.num_slots
    survivor = request("survivor", prompt(6, 3), greedy(9))
    for req in (request("aborted", prompt(4, 2), greedy(9)), survivor):
        eng.add_request(req)
    got: dict[str, list[int]] = {}
    for _ in range(4):
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert eng._deferred is not None  # the abort comes while a step is in flight
    eng.abort_request("aborted")
    run = drain(eng)
    assert "aborted" not in run.tokens
    alone = tokens_of(loaded, False, [request("survivor", prompt(6, 3), greedy(9))])
    assert got["survivor"] + run.tokens["survivor"] == alone["survivor"][0]
    assert eng.kv_pool.allocator.num_free == pages and eng.state_pool.allocator.num_free == slots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host running ahead of a GPU")
def test_a_continued_step_is_launched_without_waiting_for_the_gpu(
        tiny_artifact: Callable[[str], Path], untuned_kernels: None) -> None:
    """The point of the overlap: with the GPU busy, step() queues the next decode step behind
    that work and returns with the step before it (already complete), the host never waiting
    for the GPU; a host-to-device copy that synchronized with the stream (as a pageable one may)
    or a read of a device value anywhere in the step would wait for it (`ops.host_copy`)."""
    eng = engine(load_artifact(tiny_artifact("dense"), "cuda"), **SMALL)
    eng.add_request(request("a", prompt(9, 1), greedy(12)))
    produced = 0
    while produced < 3:  # the prompt's token, then decode steps until they overlap
        produced += sum(len(o.new_token_ids) for o in eng.step())
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # ~0.5 s of the GPU spinning
    spinning = torch.cuda.Event()
    spinning.record()
    outputs = eng.step()
    assert not spinning.query(), "the host waited for the GPU"
    assert [len(o.new_token_ids) for o in outputs] == [1]
