"""The startup memory plan's arithmetic, and decode steps replayed through static buffers (CUDA
graphs on a GPU; the same copying and padding without capture on the CPU) equal plain steps."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import alone, count_replays, drain, engine, greedy, prompt, request

from ninfer_runtime.config import FULL_ATTENTION
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.cuda_graph import GraphShape, StepGraphs, shape_of
from ninfer_runtime.engine.device_setup import graph_example, graph_shapes, step_graphs
from ninfer_runtime.engine.memory_plan import GiB, MemoryPlanError, plan_memory
from ninfer_runtime.models.loading import load_artifact
from ninfer_runtime.ops import gdn

PLAN = dict(device="cuda:0", total=140 * GiB, other=1 * GiB, weights=18 * GiB,
            state_slots=2 * GiB, prefill_workspace=3 * GiB, step_tokens=8192,
            graph_workspace=GiB // 4,
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

    def example(shape: GraphShape) -> StepBatch:
        return StepBatch.build([Segment([0] * shape.tokens_per_seq, 0, [31], 3, "last")]
                               * shape.num_seqs, PAGE, model.device)

    graphs = StepGraphs(forward(twin), example, max_pages=8, capture=DEVICE == "cuda")
    graphs.capture_all([GraphShape.of(b, 1, "last") for b in (1, 2, 3)])
    for _ in range(3):  # three decode steps: the graph is replayed with fresh inputs
        batch = StepBatch.build(decode, PAGE, model.device)
        assert graphs.can_run(batch) and shape_of(batch) == GraphShape(3, 1, 3)
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
    graphs = StepGraphs(lambda b: (b.token_ids, b.token_ids), lambda shape: StepBatch.build(
        [Segment([0] * shape.tokens_per_seq, 0, [0], 0)] * shape.num_seqs, PAGE,
        model.device), max_pages=2, capture=False)
    graphs.capture_all([GraphShape.of(2, 1, "last")])
    one = Segment([1], 0, [0], 0)
    assert not graphs.can_run(StepBatch.build([one], PAGE, model.device))  # no such shape
    assert not graphs.can_run(StepBatch.build([one, one, one], PAGE, model.device))
    wide = Segment([1], 40, [0, 1, 2], 0)  # page table wider than max_pages
    assert not graphs.can_run(StepBatch.build([wide, one], PAGE, model.device))
    prompt_step = StepBatch.build([Segment([1, 2], 0, [0], 0)], PAGE, model.device)
    assert shape_of(prompt_step) == GraphShape(1, 2, 1) and not graphs.can_run(prompt_step)
    silent = Segment([1], 0, [0], 0, "none")  # the shape's segments, but no logits rows
    assert not graphs.can_run(StepBatch.build([silent, silent], PAGE, model.device))
    assert graphs.can_run(StepBatch.build([one, one], PAGE, model.device))


def test_a_step_loads_in_one_copy_beside_its_page_tables(model) -> None:
    """A built step's tensors reach the static step in one copy of its packed buffer (and
    one of its page tables); a tensor swapped out of it (the MTP draft loop's token ids) is
    copied on its own, so the static step holds what the step holds either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func is torch.ops.aten.copy_.default
            return func(*args, **kwargs or {})

    names = ("token_ids", "positions", "slot_mapping", "state_slots", "page_tables")
    graphs = StepGraphs(lambda b: tuple(getattr(b, n) for n in names),
                        lambda shape: StepBatch.build(
                            [Segment([0], 0, [0], 0)] * shape.num_seqs, PAGE, model.device),
                        max_pages=4, capture=False)
    graphs.capture_all([GraphShape.of(2, 1, "last")])
    step = StepBatch.build([Segment([5], 17, [3, 2], 1), Segment([6], 40, [0, 1, 4], 2)],
                           PAGE, model.device)
    swapped = replace(step, token_ids=torch.tensor([8, 9], device=model.device))
    for batch, copies in ((step, 2), (swapped, 3)):
        Copies.count = 0
        with Copies():
            loaded = graphs.run(batch)
        assert Copies.count == copies
        for name, value in zip(names[:-1], loaded, strict=False):
            assert value.tolist() == getattr(batch, name).tolist(), name
        assert loaded[-1][:, :3].tolist() == batch.page_tables.tolist()


def test_a_graph_records_the_general_path_and_replays_lone_prompts(model) -> None:
    """Only a lone prompt chunk has a lone-prompt context (its context once stored: attention
    may gather it once, ops.attention); a graph's static step never has one, so a chunk graph
    recorded from position 0 runs the general path and replays a chunk from anywhere."""
    def build(*segments: Segment) -> StepBatch:
        return StepBatch.build(list(segments), PAGE, model.device)

    assert build(Segment([1, 2, 3], 0, [0], 0)).lone_prompt_context == 3  # from position 0
    assert build(Segment([1, 2, 3], 5, [0], 0)).lone_prompt_context == 8  # after its context
    assert build(Segment([1], 0, [0], 0)).lone_prompt_context == 0  # one token: the decode path
    assert build(Segment([1, 2], 0, [0], 0), Segment([3, 4], 0, [1], 1)).lone_prompt_context == 0
    assert build(Segment([1, 2], 0, [0], 0, "all", [1, 0])).lone_prompt_context == 0  # verify
    seen: list[int] = []
    graphs = StepGraphs(lambda b: seen.append(b.lone_prompt_context) or (b.token_ids,),
                        lambda shape: build(Segment([0] * shape.tokens_per_seq, 0, [0], 0)),
                        max_pages=2, capture=False)
    graphs.capture_all([GraphShape.of(1, 3, "last")])
    for start in (0, 5):
        step = build(Segment([1, 2, 3], start, [0], 0))
        assert graphs.can_run(step)
        graphs.run(step)
    assert seen == [0, 0]


def test_attention_layers_are_told_of_lone_prompts(model, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    """Every attention layer hands ops.attention the step's lone-prompt context: a prompt's
    first chunk of 20 tokens has 20, its next 40; a step of two prompts has none."""
    from ninfer_runtime.models import layers

    seen: list[int] = []
    attend = layers.paged_attention_with_operand
    monkeypatch.setattr(layers, "paged_attention_with_operand",
                        lambda *args: seen.append(args[-1]) or attend(*args))
    caches = model.allocate_cache(8, PAGE, 2, int8_kv=True)
    for start in (0, 20):
        model.forward_batch(StepBatch.build([Segment(prompt(20, 0), start, [0, 1, 2], 0)],
                                            PAGE, model.device), caches)
    model.forward_batch(StepBatch.build([Segment(prompt(4, 0), 0, [3], 0),
                                         Segment(prompt(4, 1), 0, [4], 1)], PAGE, model.device),
                        caches)
    n = sum(kind == FULL_ATTENTION for kind in model.config.layer_types)
    assert n and seen == [20] * n + [40] * n + [0] * n


# ---- the engine's graphed shapes ----


@pytest.mark.parametrize("engine_config,prompt_shapes", [
    ({"prefill_chunk": 1024, "max_context": 70_000}, [(1, 1024, 0), (1, 1024, 1)]),
    ({"prefill_chunk": 1024, "max_context": 70_000, "spec": "mtp"},
     [(1, 1024, 0), (1, 1024, 1)]),
    ({"prefill_chunk": 2048, "max_context": 70_000}, [(1, 2048, 0), (1, 2048, 1)]),
    ({"prefill_chunk": 8192, "max_context": 70_000}, []),  # outruns the host by itself
    ({"prefill_chunk": 1024, "max_context": 70_000, "prompt_graphs": False}, []),
    ({"prefill_chunk": 1024, "max_context": 300}, [(1, 299, 0), (1, 299, 1)]),
])
def test_lone_short_prompt_chunks_get_graphs_beside_decode(engine_config: dict,
                                                            prompt_shapes: list) -> None:
    config = EngineConfig(**{"max_concurrency": 4, "prompt_graphs": True, **engine_config})
    k = config.spec_tokens
    decode = [(b, k + 1, b * (k + 1)) for b in range(1, 5)]
    shapes = [(s.num_seqs, s.tokens_per_seq, s.logits_rows) for s in graph_shapes(config)]
    assert shapes == decode + prompt_shapes
    for shape in graph_shapes(config):  # each example step has its shape
        assert shape_of(graph_example(shape, config, torch.device("cpu"))) == shape


def test_a_lone_long_prompt_replays_its_chunk_graphs(tiny_artifact: Callable[[str], Path]
                                                     ) -> None:
    """A prompt prefilling alone in chunks of 16 runs its whole chunks through the step graphs
    (captured on a GPU, their static buffers on the CPU), the last one, which samples, through
    the graph with logits, and its partial last chunk eagerly; tokens as without graphs."""
    loaded = load_artifact(tiny_artifact("moe"), DEVICE)
    reqs = [request("long", prompt(48, 1), greedy(4)), request("ragged", prompt(37, 2),
                                                                greedy(4))]
    config = dict(prefill_chunk=16, max_context=128, kv_dtype="bf16", max_concurrency=1,
                  prompt_graphs=True)
    plain = alone(loaded, reqs, cuda_graphs=False, **config)
    eng = engine(loaded, **config)  # on a GPU it captures its graphs
    if eng.graphs is None:
        eng.graphs = step_graphs(loaded.model, eng.caches, eng.config, capture=False)
    assert {(1, 16, 0), (1, 16, 1)} <= {(s.num_seqs, s.tokens_per_seq, s.logits_rows)
                                        for s in eng.graphs.shapes}
    replays = count_replays(step=eng.graphs)
    tokens = {}
    for req in reqs:
        tokens.update(drain(eng, [req]).tokens)
    assert tokens == plain
    # 48 = 3 chunks (the last with logits), 37 = 2 chunks + 5 eagerly; 4 + 4 decode steps
    # minus the two first tokens, sampled by the prompts' last steps
    assert replays == {("step", 16): 5, ("step", 1): 6}


@pytest.mark.skipif(DEVICE != "cuda" or not gdn.fla_installed(),
                    reason="graph capture beside fla-core's kernels needs a GPU and fla-core")
def test_a_prompt_chunk_graph_warms_up_the_kernels_it_captures(model, monkeypatch) -> None:
    """A graph cannot hold fla-core's GDN prompt kernels (they read segment bounds on the
    host), so it holds ours; the eager runs before the capture must take ours too, or our
    scan's autotuner first times its configs inside the capture and invalidates it (the 27B's
    engine start failed so on the H100, docs/perf.md, twenty-second run). Outside a graph
    the same step takes fla's."""
    monkeypatch.delenv("NINFER_GDN_PROMPT", raising=False)
    took: list[bool] = []
    takes = gdn._takes_fla
    monkeypatch.setattr(gdn, "_takes_fla", lambda v: took.append(takes(v)) or took[-1])
    caches = model.allocate_cache(4, PAGE, 1, int8_kv=True)

    def chunk(shape: GraphShape) -> StepBatch:
        return StepBatch.build([Segment(prompt(shape.tokens_per_seq, 1), 0, [0, 1], 0)],
                               PAGE, model.device)

    graphs = StepGraphs(lambda b: (model.forward_batch(b, caches),), chunk, max_pages=2)
    graphs.capture_all([GraphShape.of(1, 24, "last")])
    assert took and not any(took)
    took.clear()
    model.forward_batch(chunk(GraphShape.of(1, 24, "last")), caches)
    assert took and all(took)
