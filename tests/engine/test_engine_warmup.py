"""The start-up warm-up (engine.warmup): its steps meet every shape-dependent autotune key that
a step of real requests can have, and they run (here on the CPU, through the references)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from ninfer_runtime.config import ModelConfig
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.device_setup import warm_up, warm_up_proposer, warmup_batch
from ninfer_runtime.engine.kv_pool import pages_for
from ninfer_runtime.engine.warmup import (
    DECODE_WARMUP_CONTEXT,
    Gpu,
    WarmupStep,
    step_keys,
    warmup_steps,
)
from ninfer_runtime.models.cache import GDNSlots
from ninfer_runtime.models.loading import LoadedModel
from ninfer_runtime.profiles import PROFILES

H200 = Gpu(132, dequantized_experts=True)


def met(steps: Sequence[WarmupStep], model: ModelConfig, gpu: Gpu) -> set:
    return {key for s in steps for key in step_keys(s.num_tokens, s.num_seqs, model, gpu)}


def gemm_buckets(steps: Sequence[WarmupStep]) -> set[int]:
    """The packed GEMM's row buckets (ops.quant_linear) the prompt steps meet."""
    return {1 << (s.num_tokens - 1).bit_length() for s in steps
            if not s.decode and 16 < s.num_tokens < 512}


@pytest.mark.parametrize("profile", ["qwen3_6_27b", "qwen3_6_35b_a3b"])
@pytest.mark.parametrize("gpu,engine", [
    (H200, {"prefill_chunk": 1024, "max_concurrency": 8}),
    (H200, {"prefill_chunk": 256, "max_concurrency": 16, "spec": "mtp"}),
    (H200, {"prefill_chunk": 8192, "max_concurrency": 8, "max_batched_tokens": 8192}),
    (Gpu(78, dequantized_experts=False), {"prefill_chunk": 16, "max_concurrency": 8}),
    (Gpu(108, dequantized_experts=False), {"prefill_chunk": 8192, "max_batched_tokens": 8192}),
])
def test_warm_up_meets_every_key_a_step_can_have(profile: str, gpu: Gpu, engine: dict) -> None:
    """Brute force: B segments of 1..chunk tokens each, every N they can sum to within the
    step's budget."""
    config = EngineConfig(max_context=70_000, **engine)
    model = PROFILES[profile].config
    chunk, c = config.prefill_chunk, config.max_concurrency
    every = {key for b in range(1, c + 1)
             for n in range(b, min(b * chunk, config.step_tokens) + 1)
             for key in step_keys(n, b, model, gpu)}
    assert met(warmup_steps(config, model, gpu), model, gpu) == every


@pytest.mark.parametrize("chunk,gpu,dequantized", [
    (8192, H200, True), (1024, H200, False), (8192, Gpu(108, dequantized_experts=False), False)])
def test_long_35b_prompt_steps_warm_the_dequantized_experts(chunk: int, gpu: Gpu,
                                                           dequantized: bool) -> None:
    """An 8K prompt step has ~287 pairs per stacked expert: the dequantized MoE path (whose
    kernels then compile in the warm-up) where it runs; 1,024-token chunks, and every prompt on
    a GPU without it, warm the grouped GEMM's block rows."""
    config = EngineConfig(prefill_chunk=chunk, max_batched_tokens=chunk, max_context=70_000)
    model = PROFILES["qwen3_6_35b_a3b"].config
    moe = {key for kernel, key in met(warmup_steps(config, model, gpu), model, gpu)
           if kernel == "moe" and not isinstance(key, tuple)}
    assert ("dequantized" in moe) == dequantized
    assert 64 in moe  # the grouped GEMM's tallest blocks, of the longest prompt steps it runs


def test_the_27b_warm_up_at_chunk_1024_and_8_requests() -> None:
    config = EngineConfig(prefill_chunk=1024, max_concurrency=8, max_context=70_000)
    steps = warmup_steps(config, PROFILES["qwen3_6_27b"].config, H200)
    prompt = [s for s in steps if not s.decode]
    # a long prompt's first chunk, then its second after the first is cached
    assert steps[:2] == [WarmupStep(1024, 1), WarmupStep(1024, 1, context=1024)]
    assert gemm_buckets(prompt) == {32, 64, 128, 256, 512}
    for bucket in (32, 64, 128, 256, 512):  # N divisible by 16 and not (Triton compiles both)
        assert {s.num_tokens % 16 == 0 for s in prompt
                if bucket // 2 < s.num_tokens <= bucket} == {True, False}
    assert any(s.num_seqs > 1 for s in prompt)  # chunks of several requests in one step
    # decode steps after a long context: the attention decode is timed where it matters
    assert [s for s in steps if s.decode] == [WarmupStep(b, b, DECODE_WARMUP_CONTEXT,
                                                         decode=True) for b in range(1, 9)]
    for s in prompt:
        assert s.num_seqs <= 8 and min(s.chunks) >= 1 and max(s.chunks) <= 1024
        assert sum(s.chunks) == s.num_tokens and s.context + max(s.chunks) < 70_000
    assert len(steps) == len(set(steps))


def test_short_chunks_reach_the_buckets_their_sum_can() -> None:
    """Chunks of 16 tokens (the decode GEMV's rows) reach the GEMM only as several requests'
    chunks in one step: up to 8 x 16 rows. A prompt never exceeds one chunk here."""
    config = EngineConfig(prefill_chunk=16, max_concurrency=8, max_context=17)
    steps = warmup_steps(config, PROFILES["qwen3_6_27b"].config, H200)
    assert gemm_buckets(steps) == {32, 64, 128}
    assert all(s.context == 0 for s in steps if not s.decode)
    # the decode steps' context is capped by the requests' (a token is left to decode)
    assert {s.context for s in steps if s.decode} == {16}


def test_verify_steps_with_spec() -> None:
    config = EngineConfig(prefill_chunk=512, max_concurrency=4, max_context=4096, spec="mtp",
                          draft_tokens=3)
    steps = warmup_steps(config, PROFILES["qwen3_6_35b_a3b"].config, H200)
    assert [s for s in steps if s.decode] == [WarmupStep(4 * b, b, 4096 - 4, decode=True)
                                              for b in range(1, 5)]
    assert steps[1] == WarmupStep(512, 1, context=512)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_warm_up_step_runs(tiny_model: Callable[[str], LoadedModel], kind: str) -> None:
    """The steps as batches (prompt chunks after their context, decode steps) through the
    model, on a cache as small as the measurement's scratch."""
    model = tiny_model(kind).model
    config = EngineConfig(prefill_chunk=16, max_context=40, max_concurrency=3)
    steps = warmup_steps(config, model.config, H200)
    assert any(s.context for s in steps) and any(s.decode for s in steps)
    for step in steps:
        batch = warmup_batch(step, config, model.device)
        assert batch.num_tokens == step.num_tokens
        assert batch.state_slots.tolist() == list(range(step.num_seqs))
        assert batch.positions.min().item() == step.context
    span = max(s.context + max(s.chunks) for s in steps)
    caches = model.allocate_cache(pages_for(span, config.page_size), config.page_size,
                                  config.max_concurrency, True)
    warm_up(model, caches, config, steps)
    # no NaN state: on the GPU a NaN hidden would route MoE tokens to no valid expert
    assert all(torch.isfinite(c.recurrent).all() for c in caches if isinstance(c, GDNSlots))


def test_sampler_warm_up_launches_every_sampling_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's warm-up reaches both Triton sampling kernels (penalties and the draw),
    and the draw with and without filters on both types of scores it meets (the model's
    logits, the fp32 scores of a batch with penalties), so that their compilation falls in
    the start-up, not in the first request."""
    from ninfer_runtime.engine.device_setup import warm_up_sampler
    from ninfer_runtime.ops import sampling

    monkeypatch.setenv("NINFER_OPS", "triton")
    penalties, draws = set(), set()
    launch_penalties, launch_sample = sampling._launch_penalties, sampling._launch_sample

    def penalise(scores: torch.Tensor, *args: object) -> torch.Tensor:
        penalties.add(scores.dtype)
        return launch_penalties(scores, *args)

    def draw(scores: torch.Tensor, rows: sampling.RowSampling) -> torch.Tensor:
        draws.add((scores.dtype, bool(rows.candidates) or rows.any_min_p))
        return launch_sample(scores, rows)

    monkeypatch.setattr(sampling, "_launch_penalties", penalise)
    monkeypatch.setattr(sampling, "_launch_sample", draw)
    warm_up_sampler(torch.randn(3, 300).bfloat16())
    assert penalties == {torch.bfloat16}
    assert draws == {(dtype, filtered) for dtype in (torch.bfloat16, torch.float32)
                     for filtered in (False, True)}


def test_the_proposer_warm_up_runs_decode_steps_whose_context_does_not_fit(
        tiny_model: Callable[[str], LoadedModel]) -> None:
    """With caches too small for the decode steps' context, a proposer still drafts for every
    decode step, from position 0 (the context is only there to time attention configs);
    prompt steps that don't fit are skipped, as before."""
    model = tiny_model("dense").model
    config = EngineConfig(prefill_chunk=16, max_context=400, max_concurrency=2, spec="mtp",
                          draft_tokens=2)
    steps = warmup_steps(config, model.config, H200)
    assert {s.context for s in steps if s.decode} == {397}
    starts: list[list[int]] = []

    class Recorder:
        taps = ()

        def propose(self, hidden: torch.Tensor, taps: object, committed: list) -> None:
            if all(c.propose for c in committed):
                starts.append([c.start for c in committed])

    warm_up_proposer(Recorder(), model, config, steps, num_pages=1)
    assert starts == [[0], [0, 0]]
