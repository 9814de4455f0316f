"""The step shapes the engine runs once at start-up, so that no request pays for Triton's tuning.

Triton tunes an autotuned kernel on the first launch of each new key, compiling and timing every
config: seconds per key. Inside a request that is lost time (a 35B server's first request, a
7,680-token prompt, ran at 1,180 tok/s, a 64K prompt after it at 8,506), and it must be done
before a CUDA graph records the kernel. The kernels keep what they tuned in Triton's cache
directory (`cache_results`), so a restart re-times nothing; the warm-up is what makes a first
start tune before it serves.

The keys that change from step to step depend on the step's shape alone:
- its N tokens: the packed GEMM's row bucket, next_power_of_2(N) for SKINNY_MAX_M < N <
  DEQUANT_MIN_M (ops.quant_linear; fewer rows take the decode GEMV, tuned once per weight
  and row tile, one row apart, `decode_plan_rows`; more a dequantized cuBLAS GEMM,
  untuned), and the MoE experts' path, block rows (ops.moe) or, at decode sizes, the power
  of two of N its tensor-core stages are tuned for, or for long prompts the dequantized path
  (untuned, but its kernels compile on first use);
- N and its B segments: the attention launch plan, BLOCK_M and NUM_SPLITS (ops.attention).
The cached context before a chunk changes none of them (attention is causal whatever it is),
the other keys are the model's sizes (GDN's chunked kernel, the decode GEMVs, the MoE GEMV),
and a step has as many logits rows (lm_head) as some decode or verify step, which the warm-up
runs at every batch size.

A step of B segments (B <= max_concurrency, each at most a chunk) can have any N in
[B, B * chunk] within the step's budget (config.step_tokens). For a given B each key is
piecewise constant in N, so `warmup_steps` finds the runs of N with equal keys and keeps runs,
those with the most unmet values first, until every value of every key is met. A proposer's
passes over a step's rows meet the same keys and its own weights'
(engine.device_setup.warm_up_proposer runs it over the same steps).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ninfer_runtime.config import ModelConfig
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.ops.attention import launch_plan
from ninfer_runtime.ops.moe import DECODE_MAX_TOKENS, dequantizes_experts, grouped_block_m
from ninfer_runtime.ops.quant_linear import DEQUANT_MIN_M, SKINNY_MAX_M, decode_plan_rows

Keys = frozenset[tuple[str, object]]  # (kernel, the shape-dependent part of its key)


@dataclass(frozen=True)
class Gpu:
    """What of the GPU the keys depend on: its SM count (the attention plan) and whether the
    model's long MoE prompts can take the dequantized path there (`moe.dequantized_path_runs`:
    bf16 on sm_90/sm_100), else they stay on the grouped GEMM's block-row keys."""
    num_sms: int
    dequantized_experts: bool

# Cached tokens before each request of a decode (verify) warm-up step. The attention kernel's
# key does not hold the context, so the config its first launch times serves every context:
# timed over none, the INT8 KV decode's configs ran about equally and the pick was noise (the
# H200 took a non-prefetching config on one machine, whose 8K steps then spent 0.78 ms in
# attention against 0.35-0.42 with the prefetching one, docs/perf.md, tenth run). The
# requests of a warm-up step share these pages, so they cost a few MB whatever the batch.
DECODE_WARMUP_CONTEXT = 8192


@dataclass(frozen=True, slots=True)
class WarmupStep:
    """`num_tokens` tokens in `num_seqs` segments: prompt chunks of near-equal lengths, each
    after `context` cached tokens, or with `decode` one decode (verify) segment per request."""

    num_tokens: int
    num_seqs: int
    context: int = 0
    decode: bool = False

    @property
    def chunks(self) -> list[int]:
        """The prompt chunks' lengths."""
        q, r = divmod(self.num_tokens, self.num_seqs)
        return [q + 1] * r + [q] * (self.num_seqs - r)


def step_keys(num_tokens: int, num_seqs: int, model: ModelConfig, gpu: Gpu) -> Keys:
    """The keys of a step of this shape that vary with it, on `gpu`."""
    n = num_tokens
    gemm = ("gemv", decode_plan_rows(n)) if n <= SKINNY_MAX_M else "cublas" if n >= DEQUANT_MIN_M \
        else 1 << (n - 1).bit_length()
    nkv = model.num_key_value_heads
    plan = launch_plan(n, num_seqs, model.num_attention_heads // nkv, nkv, gpu.num_sms)
    keys = {("linear", gemm), ("attention", (plan.block_m, plan.num_splits))}
    if model.is_moe:
        # the shared expert: one more slot per token, one more stacked expert
        pairs, experts = n * (model.num_experts_per_tok + 1), model.num_experts + 1
        dequantized = gpu.dequantized_experts and dequantizes_experts(pairs, experts)
        keys.add(("moe", ("gemv", 1 << (n - 1).bit_length()) if n <= DECODE_MAX_TOKENS else
                  "dequantized" if dequantized else grouped_block_m(pairs, experts)))
    return frozenset(keys)


def _runs(num_seqs: int, chunk: int, budget: int, model: ModelConfig, gpu: Gpu
          ) -> Iterator[tuple[int, int, Keys]]:
    """(first N, last N, keys) of each run of N in [B, min(B * chunk, budget)] with equal
    keys, for B = num_seqs. Each key is monotone in N (NUM_SPLITS within one BLOCK_M), so
    equal keys form a single run: bisect for its end."""
    lo, hi = num_seqs, min(num_seqs * chunk, budget)
    while lo <= hi:
        first = step_keys(lo, num_seqs, model, gpu)
        a, z = lo, hi
        while a < z:
            mid = (a + z + 1) // 2
            a, z = (mid, z) if step_keys(mid, num_seqs, model, gpu) == first \
                else (a, mid - 1)
        yield lo, a, first
        lo = a + 1


def _largest(lo: int, hi: int) -> set[int]:
    """The largest N in [lo, hi] of each divisibility by 16: Triton compiles a kernel once per
    divisibility of its integer arguments (N among them) by 16, beside the key's tuning."""
    other = hi - 1 if hi % 16 == 0 else hi - hi % 16
    return {hi, other} if other >= lo else {hi}


def warmup_steps(config: EngineConfig, model: ModelConfig, gpu: Gpu) -> list[WarmupStep]:
    """The start-up warm-up, in order: a long prompt's first chunk and the next one after it
    (cached context), steps that meet every other key value (the largest N of each kept run,
    with N divisible by 16 and not), and a decode (verify) step at every batch size, each
    request after DECODE_WARMUP_CONTEXT cached tokens (the graphs' capture runs those shapes
    too, but without graphs they run eagerly, and so does a proposer's pass over them)."""
    chunk = min(config.prompt_chunk, config.step_tokens)
    k, c, budget = config.spec_tokens, config.max_concurrency, config.step_tokens
    steps = [WarmupStep(chunk, 1)]
    if (second := min(chunk, config.max_context - 1 - chunk)) > 0:
        steps.append(WarmupStep(second, 1, context=chunk))
    context = max(0, min(DECODE_WARMUP_CONTEXT, config.max_context - (k + 1)))
    decode = [WarmupStep(b * (k + 1), b, context, decode=True) for b in range(1, c + 1)]
    met = set().union(*(step_keys(s.num_tokens, s.num_seqs, model, gpu) for s in decode))
    runs = [(b, lo, hi, keys) for b in range(1, c + 1)
            for lo, hi, keys in _runs(b, chunk, budget, model, gpu)]
    every = set().union(*(keys for *_, keys in runs))
    kept: set[WarmupStep] = set()
    while missing := every - met:
        b, lo, hi, keys = max(runs, key=lambda run: len(run[3] & missing))
        kept |= {WarmupStep(n, b) for n in _largest(lo, hi)}
        met |= keys
    kept -= set(steps)
    return steps + sorted(kept, key=lambda s: (s.num_seqs, s.num_tokens)) + decode
