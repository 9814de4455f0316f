"""Page and slot allocators, the pools over them, KV capacity, the StepBatch and the scheduler
(pure Python over small pools; no model)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.kv_pool import (
    KVPool,
    OutOfPagesError,
    PageAllocator,
    kv_bytes_per_token,
    resolve_kv_capacity,
)
from ninfer_runtime.engine.request import AdmissionError, EngineRequest, SamplingParams
from ninfer_runtime.engine.request_state import RequestState
from ninfer_runtime.engine.sampler import SamplerState
from ninfer_runtime.engine.scheduler import Scheduler
from ninfer_runtime.engine.state_pool import OutOfSlotsError, SlotAllocator, StatePool
from ninfer_runtime.models.cache import GDNSlots, PagedKV
from ninfer_runtime.profiles import get_profile

TINY = get_profile("tiny_dense").config


def test_page_allocator_counts_references() -> None:
    alloc = PageAllocator(5)
    a = alloc.allocate(3)
    assert a == [0, 1, 2] and alloc.num_free == 2
    assert all(alloc.refcount(p) == 1 for p in a)
    alloc.share(a[:2])  # a second holder of pages 0 and 1
    alloc.release(a)
    assert alloc.num_free == 3 and alloc.refcount(0) == 1 and alloc.refcount(2) == 0
    with pytest.raises(OutOfPagesError, match="4 pages asked for, 3 free"):
        alloc.allocate(4)
    b = alloc.allocate(3)
    assert sorted(b) == [2, 3, 4] and alloc.num_free == 0
    alloc.release(a[:2])
    alloc.release(b)
    assert alloc.num_free == 5
    with pytest.raises(ValueError, match="already free"):
        alloc.release([0])
    with pytest.raises(ValueError, match="cannot be shared"):
        alloc.share([1])


def test_slot_allocator_and_state_pool() -> None:
    alloc = SlotAllocator(2)
    s0, s1 = alloc.allocate(), alloc.allocate()
    assert (s0, s1) == (0, 1) and alloc.num_free == 0
    with pytest.raises(OutOfSlotsError):
        alloc.allocate()
    alloc.release(s0)
    with pytest.raises(ValueError, match="already free"):
        alloc.release(s0)

    layers = [GDNSlots.allocate(TINY, 3, dtype=torch.float32, device="cpu") for _ in range(2)]
    pool = StatePool(layers)
    slot = pool.allocate()
    for layer in layers:  # a request leaves state behind
        layer.conv[slot].fill_(1.0)
        layer.recurrent[slot].fill_(2.0)
    extra = pool.allocate()  # e.g. a snapshot slot
    pool.copy(slot, extra)
    assert all(torch.equal(layer.recurrent[extra], layer.recurrent[slot]) for layer in layers)
    pool.release(slot)
    again = pool.allocate()
    assert again == slot  # reused, and zeroed: a fresh sequence's state
    assert all(layer.conv[again].abs().sum() == 0 and layer.recurrent[again].abs().sum() == 0
               for layer in layers)
    assert pool.allocator.num_free == 1


def test_kv_capacity() -> None:
    cfg = EngineConfig(max_context=100, max_concurrency=3, page_size=64)
    cpu = torch.device("cpu")
    assert resolve_kv_capacity(cfg, TINY, torch.float32, cpu) == 384  # 2 whole pages each
    spec = EngineConfig(max_context=128, max_concurrency=3, page_size=64, spec="mtp",
                        draft_tokens=3)
    assert resolve_kv_capacity(spec, TINY, torch.float32, cpu) == 3 * 3 * 64  # + 3 drafts
    explicit = EngineConfig(kv_capacity=65, page_size=64)
    assert resolve_kv_capacity(explicit, TINY, torch.float32, cpu) == 128
    big = get_profile("qwen3_6_27b").config  # head_dim 256: 4 fp16 scales per head
    per_head_layer = 2 * big.num_key_value_heads * big.layer_types.count("full_attention")
    assert kv_bytes_per_token(big, "int8", torch.bfloat16) == per_head_layer * (256 + 4 * 2)
    assert kv_bytes_per_token(big, "bf16", torch.bfloat16) == per_head_layer * 512


def test_step_batch_layout() -> None:
    segments = [Segment([7, 8, 9], start=5, pages=[4, 1], state_slot=2, logits="last"),
                Segment([3], start=0, pages=[0], state_slot=0, logits="none"),
                Segment([5, 6], start=3, pages=[2, 3, 6], state_slot=1, logits="all")]
    b = StepBatch.build(segments, page_size=4, device="cpu")
    assert b.num_tokens == 6
    assert b.token_ids.tolist() == [7, 8, 9, 3, 5, 6]
    assert b.positions.tolist() == [5, 6, 7, 0, 3, 4]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert b.context_lens.tolist() == [8, 1, 5]
    assert b.page_tables.tolist() == [[4, 1, 0], [0, 0, 0], [2, 3, 6]]
    # position 5 of pages [4, 1] is page 1, offset 1 -> slot 5; position 4 of [2, 3, 6] -> 12
    assert b.slot_mapping.tolist() == [5, 6, 7, 0, 11, 12]
    assert b.state_slots.tolist() == [2, 0, 1]
    assert b.logits_rows.tolist() == [2, 4, 5]
    assert b.chunked_cu_seqlens.tolist() == [0, 3, 4, 6]  # no recurrent segment
    verify = Segment([1, 2], start=4, pages=[0, 5], state_slot=3, snapshot_slots=[7, 3])
    mixed = StepBatch.build([verify, segments[0]], page_size=4, device="cpu")
    assert (mixed.recurrent_tokens, mixed.chunked_cu_seqlens.tolist()) == (2, [0, 3])
    decode = StepBatch.build([segments[1], segments[1]], page_size=4, device="cpu")
    assert (decode.recurrent_tokens, decode.chunked_cu_seqlens.tolist()) == (2, [0])
    tensors = [t for f in dataclasses.fields(b) if isinstance(t := getattr(b, f.name),
                                                               torch.Tensor)]
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in tensors)
    # one transfer for all, each field on 16 bytes (Triton specializes on pointer alignment)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(t.data_ptr() % 16 == 0 for t in tensors)
    with pytest.raises(ValueError, match="does not fit"):
        StepBatch.build([Segment([1, 2], start=3, pages=[0], state_slot=0)], 4, "cpu")


def test_a_step_whose_every_row_has_logits_hands_its_hidden_on_ungathered() -> None:
    """Decode and verify steps need every row's logits: the lm_head reads the hidden states
    themselves (no gather launch); other steps gather their logits rows."""
    hidden = torch.randn(3, 4)
    decode = StepBatch.build([Segment([1], start=0, pages=[0], state_slot=0),
                              Segment([2, 3], start=2, pages=[1], state_slot=1, logits="all")],
                             page_size=4, device="cpu")
    assert decode.logits_hidden(hidden) is hidden
    prompt = StepBatch.build([Segment([1, 2], start=0, pages=[0], state_slot=0, logits="last"),
                              Segment([3], start=2, pages=[1], state_slot=1)],
                             page_size=4, device="cpu")
    assert torch.equal(prompt.logits_hidden(hidden), hidden[[1, 2]])


def make_scheduler(pages: int, slots: int, *, concurrency: int = 4, chunk: int = 4,
                   max_context: int = 64, step_tokens: int | None = None) -> Scheduler:
    kv = KVPool([PagedKV.allocate(TINY, pages, 4, int8=True, dtype=torch.float32,
                                  device="cpu")])
    states = StatePool([GDNSlots.allocate(TINY, slots, dtype=torch.float32, device="cpu")])
    return Scheduler(concurrency, max_context, chunk, kv, states, 0,
                     step_tokens or concurrency * chunk)


def state(rid: str, prompt_len: int, max_tokens: int) -> RequestState:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    req = EngineRequest(rid, tuple(range(prompt_len)), params, 0.0)
    return RequestState(req, SamplerState.create(params, req.prompt_token_ids, 1152,
                                                 torch.device("cpu")))


def test_scheduler_admits_in_order_by_pages_and_slots() -> None:
    s = make_scheduler(pages=6, slots=2)
    a, b, c = state("a", 9, 3), state("b", 2, 2), state("c", 1, 1)
    for r in (a, b, c):
        s.add(r)
    first = s.schedule()
    # a needs ceil(12 / 4) = 3 pages, b 1 page; c waits for a state slot
    assert [r.request_id for r in first.admitted] == ["a", "b"]
    assert len(a.pages) == 3 and len(b.pages) == 1 and s.kv.allocator.num_free == 2
    assert [(w.state.request_id, w.token_ids, w.start, w.samples) for w in first.work] == [
        ("a", [0, 1, 2, 3], 0, False), ("b", [0, 1], 0, True)]
    assert first.prefilling == 2 and first.decode_ready == 0
    a.num_computed, b.num_computed = 4, 2  # what the engine does after the forward
    b.output.append(99)
    second = s.schedule()
    assert not second.admitted and len(s.waiting) == 1
    # decode segments first
    assert [(w.token_ids, w.start, w.prefill) for w in second.work] == [
        ([99], 2, False), ([4, 5, 6, 7], 4, True)]
    assert s.finish("b") is b and b.slot is None
    third = s.schedule()
    assert [r.request_id for r in third.admitted] == ["c"]
    s.finish("a")
    s.finish("c")
    assert s.kv.allocator.num_free == 6 and s.states.allocator.num_free == 2
    assert not s.has_unfinished() and s.finish("a") is None


def test_a_step_budget_serves_decodes_then_chunks_in_admission_order() -> None:
    s = make_scheduler(pages=16, slots=4, chunk=8, step_tokens=10)
    a, b, c = state("a", 2, 4), state("b", 12, 2), state("c", 6, 2)
    for r in (a, b, c):
        s.add(r)
    first = s.schedule()
    # a takes 2 of the 10 tokens, b the rest; c is not admitted while nothing is left
    assert [(w.state.request_id, len(w.token_ids)) for w in first.work] == [("a", 2), ("b", 8)]
    assert [r.request_id for r in first.admitted] == ["a", "b"] and list(s.waiting) == [c]
    a.num_computed, b.num_computed = 2, 8
    a.output.append(7)
    second = s.schedule()
    # a decodes first; b's last 4 prompt tokens; c gets what is left of the budget
    assert [(w.state.request_id, w.token_ids, w.start) for w in second.work] == [
        ("a", [7], 2), ("b", [8, 9, 10, 11], 8), ("c", [0, 1, 2, 3, 4], 0)]
    assert [r.request_id for r in second.admitted] == ["c"]
    assert sum(len(w.token_ids) for w in second.work) == 10


def test_the_first_prefilling_request_always_gets_a_token() -> None:
    # the least budget: a decode token for each of the 4 requests
    s = make_scheduler(pages=16, slots=4, chunk=8, step_tokens=4)
    reqs = [state(f"r{i}", 5, 3) for i in range(4)]
    for r in reqs:
        s.add(r)
    assert [len(w.token_ids) for w in s.schedule().work] == [4]  # r0 alone, then the queue
    reqs[0].num_computed = 4
    assert [(w.state.request_id, len(w.token_ids)) for w in s.schedule().work] == [
        ("r0", 1), ("r1", 3)]
    reqs[0].num_computed, reqs[0].output, reqs[1].num_computed = 5, [1], 3
    work = s.schedule().work  # r0 decodes, r1 finishes its prompt with what is left
    assert [(w.state.request_id, len(w.token_ids)) for w in work] == [("r0", 1), ("r1", 2),
                                                                     ("r2", 1)]


def test_scheduler_head_of_line_waits_for_pages() -> None:
    s = make_scheduler(pages=4, slots=4)
    s.add(state("big", 10, 2))  # 3 pages
    s.add(state("bigger", 12, 4))  # 4 pages: must wait for "big", and "small" waits behind it
    s.add(state("small", 1, 1))
    assert [r.request_id for r in s.schedule().admitted] == ["big"]
    assert [r.request_id for r in s.schedule().admitted] == []
    s.finish("big")
    assert [r.request_id for r in s.schedule().admitted] == ["bigger"]
    assert s.finish("small").request_id == "small"  # dropped while waiting
    assert list(s.waiting) == []


def test_scheduler_refuses_what_can_never_run() -> None:
    s = make_scheduler(pages=4, slots=1, max_context=32)
    with pytest.raises(AdmissionError, match="maximum context of 32"):
        s.add(state("long", 30, 3))
    with pytest.raises(AdmissionError, match="KV pool of 16 tokens"):
        s.add(state("wide", 10, 10))
    s.add(state("ok", 10, 6))
    with pytest.raises(AdmissionError, match="already in use"):
        s.add(state("ok", 1, 1))
