"""The startup memory plan's arithmetic, and decode steps replayed through static buffers (CUDA
graphs on a GPU; the same copying and padding without capture on the CPU) equal plain steps."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import prompt

from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.cuda_graph import GraphShape, StepGraphs, shape_of
from ninfer_runtime.engine.memory_plan import GiB, MemoryPlanError, plan_memory
from ninfer_runtime.models.loading import load_artifact

PLAN = dict(device="cuda:0", total=140 * GiB, other=1 * GiB, weights=18 * GiB,
            state_slots=2 * GiB, prefill_workspace=3 * GiB, step_tokens=8192,
            decode_workspace=GiB // 4,
            kv_bytes_per_token=34_816, page_size=64, max_context=262_144, max_concurrency=8,
            use_cuda_graphs=True)


def test_auto_capacity_takes_what_is_left_after_the_margin() -> None:
    plan = plan_memory(**{**PLAN, "max_concurrency": 64}, kv_capacity="auto")
    fixed = 1 + 18 + 2 + 3 + 0.5  # GiB: other, weights, slots, prefill, graph pool (2 x 1/4)
    assert plan.margin == int(0.03 * 140 * GiB)
    room = 140 * GiB - int(fixed * GiB) - plan.margin
    assert plan.kv_capacity == room // (34_816 * 64) * 64
    assert plan.kv == plan.kv_capacity * 34_816
    assert 0 <= plan.free < 34_816 * 64
    assert plan.max_full_context_requests == plan.kv_capacity // 262_144 >= 1
    assert "KV pages" in plan.table() and "262,144" in plan.table()
    assert "8,192 tokens a step" in plan.table()


def test_auto_capacity_stops_at_what_the_requests_can_use() -> None:
    plan = plan_memory(**{**PLAN, "max_context": 8192}, kv_capacity="auto")
    assert plan.kv_capacity == 8 * 8192
    assert plan.free > 100 * GiB


def test_requests_reserve_whole_pages_and_their_draft_positions() -> None:
    plan = plan_memory(**{**PLAN, "max_context": 8192 + 10}, kv_capacity="auto",
                       spec_tokens=7)
    assert plan.request_pages == 129 and plan.kv_capacity == 8 * 129 * 64
    assert plan.max_full_context_requests == 8


def test_no_graphs_no_graph_pool() -> None:
    assert plan_memory(**{**PLAN, "use_cuda_graphs": False}, kv_capacity="auto").graph_pool == 0


def test_explicit_capacity_must_fit() -> None:
    plan = plan_memory(**PLAN, kv_capacity=100_000)
    assert plan.kv_capacity == 100_032  # whole pages
    with pytest.raises(MemoryPlanError, match="does not fit.*\n.*memory plan"):
        plan_memory(**PLAN, kv_capacity=10_000_000)


def test_auto_refuses_a_device_where_one_full_context_request_does_not_fit() -> None:
    with pytest.raises(MemoryPlanError, match="not even one request"):
        plan_memory(**{**PLAN, "weights": 126 * GiB}, kv_capacity="auto")


# ---- step graphs ----

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16


@pytest.fixture(scope="module")
def model(tiny_artifact: Callable[[str], Path]):
    return load_artifact(tiny_artifact("dense"), DEVICE).model


def _prefilled(model, lengths: list[int]) -> tuple[list, list[Segment]]:
    """Caches holding one prompt per sequence (slot b, its own pages), and the decode step
    that continues each."""
    caches = model.allocate_cache(32, PAGE, 4, int8_kv=True)
    segments, decode, first = [], [], 0
    for b, n in enumerate(lengths):
        pages = list(range(first, first + -(-(n + 1) // PAGE)))
        first += len(pages)
        segments.append(Segment(prompt(n, b), 0, pages, b, "last"))
        decode.append(Segment([7 + b], n, pages, b, "last"))
    model.forward_batch(StepBatch.build(segments, PAGE, model.device), caches)
    return caches, decode


def test_decode_steps_through_static_buffers_equal_plain_steps(model) -> None:
    caches, decode = _prefilled(model, [5, 37, 20])
    twin = copy.deepcopy(caches)

    def forward(caches):
        def run(batch: StepBatch):
            hidden = model.forward_batch(batch, caches)
            return hidden, model.logits(hidden[batch.logits_rows])
        return run

    def example(num_seqs: int, tokens: int) -> StepBatch:
        return StepBatch.build([Segment([0] * tokens, 0, [31], 3, "last")] * num_seqs, PAGE,
                               model.device)

    graphs = StepGraphs(forward(twin), example, max_pages=8, capture=DEVICE == "cuda")
    graphs.capture_all([GraphShape(b, 1) for b in (1, 2, 3)])
    for _ in range(3):  # three decode steps: the graph is replayed with fresh inputs
        batch = StepBatch.build(decode, PAGE, model.device)
        assert graphs.can_run(batch) and shape_of(batch) == GraphShape(3, 1)
        hidden, logits = forward(caches)(batch)
        g_hidden, g_logits = graphs.run(batch)
        torch.testing.assert_close(g_hidden, hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g_logits, logits, atol=1e-3, rtol=1e-4)
        decode = [Segment([int(logits[i].argmax())], s.start + 1, s.pages, s.state_slot)
                  for i, s in enumerate(decode)]
    # The sequences' own pages and slots; the capture wrote the example's (page 31, slot 3).
    owned = {"k": slice(0, 31), "v": slice(0, 31), "conv": slice(0, 3), "recurrent": slice(0, 3)}
    for mine, theirs in zip(caches, twin, strict=True):
        for name, rows in owned.items():
            if hasattr(mine, name):
                torch.testing.assert_close(getattr(theirs, name)[rows].float(),
                                           getattr(mine, name)[rows].float(), atol=1e-4, rtol=1e-4)


def test_steps_without_a_graph_are_refused(model) -> None:
    graphs = StepGraphs(lambda b: (b.token_ids, b.token_ids), lambda b, t: StepBatch.build(
        [Segment([0] * t, 0, [0], 0)] * b, PAGE, model.device), max_pages=2, capture=False)
    graphs.capture_all([GraphShape(2, 1)])
    one = Segment([1], 0, [0], 0)
    assert not graphs.can_run(StepBatch.build([one], PAGE, model.device))  # no such shape
    assert not graphs.can_run(StepBatch.build([one, one, one], PAGE, model.device))
    wide = Segment([1], 40, [0, 1, 2], 0)  # page table wider than max_pages
    assert not graphs.can_run(StepBatch.build([wide, one], PAGE, model.device))
    prompt_step = StepBatch.build([Segment([1, 2], 0, [0], 0)], PAGE, model.device)
    assert shape_of(prompt_step) == GraphShape(1, 2) and not graphs.can_run(prompt_step)
    assert graphs.can_run(StepBatch.build([one, one], PAGE, model.device))
