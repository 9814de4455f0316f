"""The engine end to end on tiny random-init artifacts: batching, chunked prefill and INT8 KV
change nothing they should not; admission, queueing, abort, stopping, stats and intervals."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from engine_helpers import TickingClock, alone, drain, engine, greedy, prompt, request

from ninfer_runtime import LLM
from ninfer_runtime.config import ModelConfig
from ninfer_runtime.engine import AdmissionError, Engine, EngineConfig, SamplingParams
from ninfer_runtime.engine.engine import check_context
from ninfer_runtime.engine.request import RequestStats, SpecCounters
from ninfer_runtime.models.loading import LoadedModel

ModelFactory = Callable[[str], LoadedModel]
VOCAB = 1152


def mixed_requests(n: int = 6, *, max_tokens: int = 8, seed: int = 0, **sampling: object) -> list:
    """n greedy requests of mixed prompt lengths (1 to 70 tokens) and token budgets."""
    lengths = [1, 5, 17, 40, 70, 3, 29, 11]
    return [request(f"r{i}", prompt(lengths[i % len(lengths)], seed + i),
                    greedy(max_tokens - i % 3, **sampling)) for i in range(n)]


def logprobs_vector(lp: object) -> torch.Tensor:
    """The full log-distribution from a TokenLogprob with top = the whole vocabulary."""
    out = torch.full((VOCAB,), float("nan"))
    for token, value in lp.top:
        out[token] = value
    assert not out.isnan().any()
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("kv_dtype", ["int8", "bf16"])
def test_batched_equals_alone(tiny_model: ModelFactory, kind: str, kv_dtype: str) -> None:
    loaded = tiny_model(kind)
    reqs = mixed_requests()
    config = {"kv_dtype": kv_dtype, "prefill_chunk": 16, "max_context": 128}
    eng = engine(loaded, max_concurrency=4, wall_clock=TickingClock(), **config)
    run = drain(eng, reqs)
    assert run.tokens == alone(loaded, reqs, **config)
    for req in reqs:
        last = run.finished(req.request_id)
        assert last.finish_reason == "length"
        assert len(run.tokens[req.request_id]) == req.sampling.max_tokens
    records = eng.intervals()
    assert max(r["running"] for r in records) == 4
    # prompt chunks and decode tokens really shared steps
    assert any(r["prefilling"] and r["decode_ready"] for r in records)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_step_budget_changes_no_token(tiny_model: ModelFactory, kind: str) -> None:
    loaded = tiny_model(kind)
    reqs = mixed_requests()
    config = {"kv_dtype": "int8", "prefill_chunk": 16, "max_context": 128}
    budget = 7  # a decode token for each of 4 requests, and 3 prompt tokens
    eng = engine(loaded, max_concurrency=4, max_batched_tokens=budget,
                 wall_clock=TickingClock(), **config)
    assert drain(eng, reqs).tokens == alone(loaded, reqs, **config)
    records = eng.intervals()
    assert all(r["computed_prefill_tokens"] + r["decode_ready"] <= budget for r in records)
    assert any(r["computed_prefill_tokens"] + r["decode_ready"] == budget for r in records)


def test_the_step_budget_holds_a_decode_step() -> None:
    EngineConfig(max_concurrency=4, max_batched_tokens=4)
    with pytest.raises(ValueError, match="below a decode step of max_concurrency requests"):
        EngineConfig(max_concurrency=4, max_batched_tokens=3)
    with pytest.raises(ValueError, match=r"\(8 tokens\)"):
        EngineConfig(max_concurrency=2, spec="mtp", draft_tokens=3, max_batched_tokens=7)
    assert EngineConfig(max_concurrency=4, prefill_chunk=100).step_tokens == 400
    assert EngineConfig(max_concurrency=4, prefill_chunk=100,
                        max_batched_tokens=256).step_tokens == 256
    assert EngineConfig(max_concurrency=2, prefill_chunk=1, spec="mtp").step_tokens == 8
    # the default budget: one 8K prompt, or eight 1,024-token chunks, a step
    assert EngineConfig().step_tokens == EngineConfig(prefill_chunk=1024).step_tokens == 8192
    assert EngineConfig(max_context=70_000, max_concurrency=16,
                        prefill_chunk=1024).step_tokens == 8192
    # unless a decode step of every request is more
    assert EngineConfig(max_concurrency=4096, spec="mtp").step_tokens == 4096 * 4


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(tiny_model: ModelFactory, chunk: int) -> None:
    loaded = tiny_model("dense")
    reqs = [request("long", prompt(100, 1), greedy(5, logprobs=VOCAB)),
            request("short", prompt(9, 2), greedy(5, logprobs=VOCAB))]
    config = {"kv_dtype": "bf16", "max_context": 128, "max_concurrency": 2}
    one_shot = drain(engine(loaded, prefill_chunk=4096, **config), reqs)
    chunked = drain(engine(loaded, prefill_chunk=chunk, **config), reqs)
    assert chunked.tokens == one_shot.tokens
    for rid in ("long", "short"):
        first = [logprobs_vector(run.outputs[rid][0].new_logprobs[0])
                 for run in (chunked, one_shot)]
        torch.testing.assert_close(*first, rtol=0, atol=2e-5)


def test_greedy_output_is_the_reference_models(tiny_model: ModelFactory) -> None:
    """bf16 (unquantized) KV at concurrency 4: every token is the argmax of a full forward of
    the sequence so far (LLM.score), and the first token's logprobs are its log_softmax."""
    loaded = tiny_model("dense")
    llm = LLM.from_model(loaded.model)
    reqs = mixed_requests(4, max_tokens=5, seed=10, logprobs=VOCAB)
    run = drain(engine(loaded, kv_dtype="bf16", max_concurrency=4, prefill_chunk=16,
                       max_context=128), reqs)
    for req in reqs:
        seq = list(req.prompt_token_ids)
        reference_first = torch.log_softmax(llm.score(seq)[-1], -1)
        for token in run.tokens[req.request_id]:
            assert llm.score(seq)[-1].argmax().item() == token
            seq.append(token)
        first = logprobs_vector(run.outputs[req.request_id][0].new_logprobs[0])
        torch.testing.assert_close(first, reference_first, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_int8_kv_keeps_the_logits_close(tiny_model: ModelFactory, kind: str) -> None:
    """First-token logprobs with INT8 KV against unquantized KV, for prompts long enough that
    the attention layers read many quantized keys."""
    loaded = tiny_model(kind)
    reqs = [request(f"p{n}", prompt(n, n), greedy(1, logprobs=VOCAB)) for n in (5, 70, 120)]
    runs = {kv: drain(engine(loaded, kv_dtype=kv, max_context=128, max_concurrency=3), reqs)
            for kv in ("int8", "bf16")}
    for req in reqs:
        int8, exact = (logprobs_vector(runs[kv].outputs[req.request_id][0].new_logprobs[0])
                       for kv in ("int8", "bf16"))
        err = (int8 - exact).abs().max().item()
        spread = (exact.max() - exact.min()).item()
        assert 0 < err < 0.01 * spread, f"{req.request_id}: error {err:.3g}, spread {spread:.3g}"


def test_load_of_32_requests(tiny_model: ModelFactory) -> None:
    """32 requests at concurrency 4: all complete, each as it does alone; the interval records
    add up to the work done."""
    loaded = tiny_model("dense")
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 40, (32,), generator=gen).tolist()
    budgets = torch.randint(1, 8, (32,), generator=gen).tolist()
    reqs = [request(f"q{i}", prompt(n, 100 + i), greedy(m))
            for i, (n, m) in enumerate(zip(lengths, budgets, strict=True))]
    config = {"prefill_chunk": 16, "max_context": 64}
    eng = engine(loaded, max_concurrency=4, wall_clock=TickingClock(), **config)
    run = drain(eng, reqs)
    assert run.tokens == alone(loaded, reqs, **config)
    assert all(len(run.tokens[r.request_id]) == r.sampling.max_tokens for r in reqs)
    records = eng.intervals()
    generated = sum(budgets)
    assert sum(r["committed_decode_tokens"] for r in records) == generated
    assert sum(sum(r["rows_per_round"]) for r in records) == generated
    assert all(r["decode_rounds"] == len(r["rows_per_round"]) for r in records)
    assert sum(r["computed_prefill_tokens"] for r in records) == sum(lengths)
    assert max(r["running"] for r in records) == 4
    assert eng.intervals(since=records[-1]["start"])[0] == records[-1]
    assert eng.kv_pool.allocator.num_free == eng.kv_pool.num_pages
    assert eng.state_pool.allocator.num_free == 4


def test_admission_refuses_what_can_never_run(tiny_model: ModelFactory) -> None:
    eng = engine(tiny_model("dense"), max_context=256, kv_capacity=128, page_size=16)
    ok = greedy(4)
    bad = [
        (request("ctx", prompt(250, 0), greedy(10)), "maximum context of 256"),
        (request("pool", prompt(100, 0), greedy(40)), "KV pool of 128 tokens"),
        (request("empty", (), ok), "empty"),
        (request("vocab", (1, VOCAB), ok), "outside the vocabulary"),
        (request("temp", (1, 2), SamplingParams(temperature=-1.0)), "temperature"),
    ]
    for req, message in bad:
        with pytest.raises(AdmissionError, match=message):
            eng.add_request(req)
    eng.add_request(request("fits", prompt(100, 0), greedy(28)))  # exactly the pool
    with pytest.raises(AdmissionError, match="already in use"):
        eng.add_request(request("fits", (1,), ok))
    assert eng.queue_depth() == 1 and drain(eng).tokens["fits"]


def test_requests_queue_for_slots_and_pages(tiny_model: ModelFactory) -> None:
    """Five requests at concurrency 2 wait for a state slot; with a 4-page pool and 3 pages
    per request they then run one at a time. Either way all are served, as alone."""
    loaded = tiny_model("dense")
    reqs = [request(f"w{i}", prompt(30 + i, 40 + i), greedy(4)) for i in range(5)]
    expected = alone(loaded, reqs, page_size=16, max_context=64)
    for capacity, running in ((256, 2), (64, 1)):
        eng = engine(loaded, max_concurrency=2, page_size=16, max_context=64,
                     kv_capacity=capacity)
        for req in reqs:
            eng.add_request(req)
        first = {o.request_id: list(o.new_token_ids) for o in eng.step()}
        assert (eng.num_running(), eng.queue_depth()) == (running, 5 - running)
        run = drain(eng)
        assert {r: first.get(r, []) + run.tokens[r] for r in run.tokens} == expected
        queued = run.finished("w4").stats
        assert queued.queue_seconds > run.finished("w0").stats.queue_seconds >= 0


def test_abort_frees_pages_and_slot_at_once(tiny_model: ModelFactory) -> None:
    loaded = tiny_model("dense")
    eng = engine(loaded, max_concurrency=3, prefill_chunk=8, max_context=64, page_size=16)
    pages, slots = eng.kv_pool.num_pages, eng.state_pool.num_slots
    prefilling = request("prefilling", prompt(40, 1), greedy(8))
    decoding = request("decoding", prompt(3, 2), greedy(20))
    survivor = request("survivor", prompt(12, 3), greedy(6))
    waiting = request("waiting", prompt(5, 4), greedy(3))
    for req in (prefilling, decoding, survivor, waiting):
        eng.add_request(req)
    outputs = eng.step()
    assert {o.request_id for o in outputs} == {"decoding"}  # the others are still prefilling
    eng.abort_request("waiting")  # never started
    assert (eng.num_running(), eng.queue_depth()) == (3, 0)
    eng.abort_request("prefilling")  # mid-prefill: 8 of 40 prompt tokens computed
    assert eng.num_running() == 2
    assert eng.kv_pool.allocator.num_free == pages - 2 - 2  # decoding's and survivor's left
    assert eng.state_pool.allocator.num_free == slots - 2
    second = eng.step()
    assert {o.request_id for o in second} == {"decoding", "survivor"}
    eng.abort_request("decoding")  # mid-decode
    eng.abort_request("no-such-request")  # ignored
    assert eng.kv_pool.allocator.num_free == pages - 2
    assert eng.state_pool.allocator.num_free == slots - 1
    run = drain(eng)
    assert set(run.outputs) == {"survivor"}  # nothing more from the aborted ones
    tokens = [o.new_token_ids[0] for o in second if o.request_id == "survivor"]
    assert tokens + run.tokens["survivor"] == alone(loaded, [survivor], prefill_chunk=8,
                                                    max_context=64, page_size=16)["survivor"]
    assert eng.kv_pool.allocator.num_free == pages and eng.state_pool.allocator.num_free == slots


def test_stop_tokens_eos_and_length(tiny_model: ModelFactory) -> None:
    loaded = tiny_model("dense")
    ids = prompt(12, 7)
    first = drain(engine(loaded), [request("a", ids, greedy(1))]).tokens["a"][0]
    plain = SamplingParams(temperature=0.0, max_tokens=5)
    stopped = drain(engine(loaded), [request("s", ids, SamplingParams(
        temperature=0.0, max_tokens=5, stop_token_ids=(first,)))])
    assert stopped.tokens["s"] == [first] and stopped.finished("s").finish_reason == "stop"
    eos_engine = engine(loaded, generation_config={"eos_token_id": [first]})
    assert eos_engine.eos_token_ids == {first, *loaded.model.config.eos_token_ids}
    assert drain(eos_engine, [request("e", ids, plain)]).finished("e").finish_reason == "stop"
    ignored = drain(eos_engine, [request("i", ids, greedy(3))])
    assert ignored.finished("i").finish_reason == "length" and len(ignored.tokens["i"]) == 3


def test_stats_are_cumulative_snapshots(tiny_model: ModelFactory) -> None:
    run = drain(engine(tiny_model("dense"), prefill_chunk=8),
                [request("r", prompt(20, 9), greedy(4, logprobs=2))])
    outs = run.outputs["r"]
    assert [o.stats.completion_tokens for o in outs] == [1, 2, 3, 4]  # not mutated later
    assert [o.finished for o in outs] == [False, False, False, True]
    final = outs[-1].stats
    assert (final.prompt_tokens, final.computed_prefill_tokens) == (20, 20)
    assert final.cached_prompt_tokens == 0 and final.vision_seconds == 0.0
    for s in (final.queue_seconds, final.prepare_seconds, final.prefill_seconds,
              final.decode_seconds):
        assert s >= 0.0
    assert outs[0].stats.decode_seconds == 0.0 and final.decode_seconds > 0.0
    assert all(len(o.new_logprobs) == 1 and len(o.new_logprobs[0].top) == 2 for o in outs)
    assert outs[0].new_logprobs[0].token_id == outs[0].new_token_ids[0]


def test_a_stats_snapshot_keeps_its_values_when_the_request_goes_on() -> None:
    stats = RequestStats(completion_tokens=3)
    stats.spec.accepted_per_position.extend([2, 1])
    snap = stats.snapshot()
    stats.completion_tokens += 1
    stats.spec.rounds += 1
    stats.spec.accepted_per_position[0] += 1
    assert snap == RequestStats(completion_tokens=3, spec=SpecCounters(
        accepted_per_position=[2, 1]))


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model: ModelFactory) -> None:
    loaded = tiny_model("moe")
    sampled = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=21, max_tokens=8,
                             ignore_eos=True, repetition_penalty=1.1, presence_penalty=0.2)
    mine = request("mine", prompt(10, 11), sampled)
    others = [request(f"o{i}", prompt(5 + 9 * i, 12 + i), SamplingParams(
        temperature=0.7, seed=i, max_tokens=6, ignore_eos=True)) for i in range(3)]
    together = drain(engine(loaded, max_concurrency=4, prefill_chunk=8), [*others, mine])
    assert together.tokens["mine"] == alone(loaded, [mine], prefill_chunk=8)["mine"]
    reseeded = request("mine", mine.prompt_token_ids, SamplingParams(
        temperature=1.0, top_p=0.95, top_k=50, seed=22, max_tokens=8, ignore_eos=True))
    assert alone(loaded, [reseeded])["mine"] != together.tokens["mine"]


def test_from_artifact(tiny_artifact: Callable[[str], object]) -> None:
    eng = Engine.from_artifact(tiny_artifact("moe"), EngineConfig(max_context=100,
                                                                  max_concurrency=3))
    assert eng.model_config.is_moe and eng.model_config.vocab_size == VOCAB
    assert eng.config.kv_capacity == 384 and eng.config.device == "cpu"  # 3 x 2 pages
    assert eng.generation_config["eos_token_id"] == [1002, 1000]
    assert eng.kv_pool.layers[0].k.dtype == torch.int8  # the default KV dtype
    ids = eng.tokenizer.encode("hello world")
    run = drain(eng, [request("t", ids, greedy(3))])
    assert len(run.tokens["t"]) == 3 and eng.intervals(since=1e12) == []


def test_a_context_past_the_models_positions_is_refused(tiny_model: ModelFactory,
                                                        tiny_artifact: Callable) -> None:
    """Past max_position_embeddings RoPE turns keys by angles the model never saw; YaRN in
    the config extends the positions to its original context times the factor."""
    model = tiny_model("dense").model
    with pytest.raises(ValueError, match="max context 262,145 exceeds the 262,144 positions "
                       "the model is made for .max_position_embeddings; YaRN"):
        Engine(model, EngineConfig(max_context=262_145))
    with pytest.raises(ValueError, match="exceeds the 262,144 positions"):  # before loading
        Engine.from_artifact(tiny_artifact("dense"), EngineConfig(max_context=262_145))
    hf = copy.deepcopy(model.config.hf_config)
    hf["text_config"]["rope_parameters"].update(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=262_144)
    extended = ModelConfig.from_hf(hf)
    check_context(1_048_576, extended)
    with pytest.raises(ValueError, match="1,048,576 positions .*original context times"):
        check_context(1_048_577, extended)

