"""What the engine does once on a GPU before serving: warm up, plan the memory, capture graphs.

The warm-up runs one step of every shape class a request can produce (engine.warmup), so that
Triton tunes its kernels here rather than inside the first requests. It runs on a scratch cache
that is freed again before the real KV pool is allocated, as does the plan's measurement: the
plan needs numbers only a run can tell, the peak activations of the largest step the
scheduler can build (config.step_tokens prompt tokens) and of the largest step a CUDA graph
records (a full decode step, or a lone prompt chunk, `graph_shapes`).
The second of two runs is measured, so that tuning (which allocates benchmark buffers on a
kernel's first call) is not counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from itertools import accumulate

import torch

from ninfer_runtime.config import FULL_ATTENTION
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.cuda_graph import GraphShape, StepGraphs, example_step
from ninfer_runtime.engine.kv_pool import kv_bytes_per_token, pages_for, request_pages
from ninfer_runtime.engine.memory_plan import MemoryPlan, peak_bytes, plan_memory
from ninfer_runtime.engine.request import SamplingParams
from ninfer_runtime.engine.sampler import SamplerState, sample
from ninfer_runtime.engine.spec import Committed, Proposer
from ninfer_runtime.engine.warmup import Gpu, WarmupStep, warmup_steps
from ninfer_runtime.models.cache import GDNSlots, LayerCache, allocate_layer_caches
from ninfer_runtime.models.qwen3_5 import Qwen3_5Model
from ninfer_runtime.ops.attention import lone_prompt_gather_bytes
from ninfer_runtime.ops.compile_ahead import warming_up
from ninfer_runtime.ops.moe import dequantized_path_runs

log = logging.getLogger("ninfer.engine")


def state_bytes_per_slot(model: Qwen3_5Model) -> int:
    """GDN conv window + recurrent state of one slot over every GDN layer."""
    cfg = model.config
    gdn = [kind for kind in cfg.layer_types if kind != FULL_ATTENTION]
    meta = allocate_layer_caches(cfg, gdn, num_pages=1, page_size=1, num_slots=1,
                                 int8_kv=False, dtype=model.dtype, device="meta")
    return sum(t.nbytes for c in meta if isinstance(c, GDNSlots) for t in (c.conv, c.recurrent))


def _forward_step(model: Qwen3_5Model, caches: list[LayerCache], batch: StepBatch,
                  taps: Sequence[int] = ()) -> tuple[torch.Tensor, ...]:
    """hidden, logits of the logits rows and, when `taps` names layers, their outputs."""
    hidden, tapped = model.forward_taps(batch, caches, taps)
    logits = model.logits(batch.logits_hidden(hidden))
    return (hidden, logits, tapped) if taps else (hidden, logits)


# A step of one prompt chunk of at most this many tokens, alone (a long prompt prefilling by
# itself), replays a graph too: its kernels are short enough for a slow host's launches to
# outlast them (the 35B's 1,024-token chunks: ~100 ms of Python against 42 ms of kernels,
# docs/perf.md, fifteenth run). Longer chunks outrun the host by themselves, and their graph
# would hold a second copy of the prefill workspace.
PROMPT_GRAPH_MAX_TOKENS = 2048


def graph_shapes(config: EngineConfig) -> list[GraphShape]:
    """The target's graphed steps: a decode (verify) step at every batch size, and with
    config.prompt_graphs a lone prompt chunk of config.prompt_chunk tokens, without logits (it
    continues) and with them (it ends the prompt), where the chunk is short
    (PROMPT_GRAPH_MAX_TOKENS)."""
    k, chunk = config.spec_tokens, min(config.prompt_chunk, config.step_tokens)
    shapes = [GraphShape.of(b, k + 1, "all") for b in range(1, config.max_concurrency + 1)]
    if config.prompt_graphs and k + 1 < chunk <= PROMPT_GRAPH_MAX_TOKENS:
        shapes += [GraphShape.of(1, chunk, "none"), GraphShape.of(1, chunk, "last")]
    return shapes


def graph_example(shape: GraphShape, config: EngineConfig, device: torch.device) -> StepBatch:
    """The step a graph of `shape` records: a decode step (`decode_batch`), or a prompt chunk
    (`example_step`)."""
    if shape.tokens_per_seq == config.spec_tokens + 1:
        return decode_batch(shape.num_seqs, config, 0, device)
    return example_step(shape, config.page_size, device)


def decode_batch(num_seqs: int, config: EngineConfig, page: int, device: torch.device,
                 context: int = 0) -> StepBatch:
    """A step of `num_seqs` decode-ready requests after `context` cached tokens on the pages
    from `page` on (shared by all of them), in state slots 0..num_seqs-1: one token each, or
    with spec a verify segment of K+1 tokens whose snapshot slots lie beyond the first
    max_concurrency."""
    k, c = config.spec_tokens, config.max_concurrency
    pages = list(range(page, page + pages_for(context + k + 1, config.page_size)))
    return StepBatch.build(
        [Segment([0] * (k + 1), context, pages, b, "all" if k else "last",
                 [*range(c + b * k, c + (b + 1) * k), b] if k else None)
         for b in range(num_seqs)], config.page_size, device)


def device_warmup_steps(model: Qwen3_5Model, config: EngineConfig) -> list[WarmupStep]:
    """`warmup_steps` for the model's GPU."""
    sms = torch.cuda.get_device_properties(model.device).multi_processor_count
    gpu = Gpu(sms, dequantized_path_runs(model.dtype, model.device))
    return warmup_steps(config, model.config, gpu)


def warmup_batch(step: WarmupStep, config: EngineConfig, device: torch.device) -> StepBatch:
    """The step on pages 0.. and state slots 0..B-1. Its segments share the pages: the warm-up
    keeps no output."""
    if step.decode:
        return decode_batch(step.num_seqs, config, 0, device, step.context)
    pages = range(pages_for(step.context + max(step.chunks), config.page_size))
    return StepBatch.build([Segment([0] * n, step.context, pages, slot)
                            for slot, n in enumerate(step.chunks)], config.page_size, device)


def warm_up(model: Qwen3_5Model, caches: list[LayerCache], config: EngineConfig,
            steps: Sequence[WarmupStep]) -> None:
    """One forward of each warm-up step (the first launch of each key tunes its kernel), then
    the sampler on the last step's logits."""
    start = time.perf_counter()
    with warming_up():  # each key's candidates compiled side by side (ops.compile_ahead)
        for step in steps:
            logits = _forward_step(model, caches, warmup_batch(step, config, model.device))[1]
    warm_up_sampler(logits)
    _synchronize(model.device)
    log.info("warm-up: %d step shapes in %.1f s", len(steps), time.perf_counter() - start)


def warm_up_sampler(logits: torch.Tensor) -> None:
    """Every sampling kernel once on each type of scores it meets, with and without filters
    (the draw's two variants): the model's logits (batches without penalties: a greedy row
    beside one with temperature, then with filters) and the fp32 scores that penalties make
    of the whole batch (with logprobs too). A kernel's first launch on a type compiles it
    (seconds on a machine whose Triton cache is cold), which would otherwise fall inside the
    first request's time to first token: the H200 engine bench saw `_sample_kernel` compile
    in the first request when the warm-up's only batch had penalties, and the H100 the
    unfiltered draw's compile in the first greedy request (thirty-sixth run)."""
    vocab, device = logits.shape[-1], logits.device
    penalties = {"presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1}
    batches = [[SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=0)],
               [SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=0)],
               [SamplingParams(temperature=0.8, seed=0, **penalties)],
               [SamplingParams(temperature=0.7, top_k=20, seed=0, logprobs=1, **penalties)]]
    for rows in batches:
        states = [SamplerState.create(params, [0], vocab, device) for params in rows]
        sample(logits[:1].expand(len(rows), vocab).contiguous(), states)


def _synchronize(device: torch.device) -> None:
    """Wait for the device's work, so that the logged time is its own (the warm-up's tests run
    on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_workspaces(model: Qwen3_5Model, config: EngineConfig) -> tuple[int, int]:
    """Peak activation bytes of (the largest prefill step, the largest graphed step: a full
    decode or verify step, or a lone prompt chunk), on the scratch cache the warm-up ran on
    first."""
    size, c = config.page_size, config.max_concurrency
    tokens = config.step_tokens
    steps = device_warmup_steps(model, config)
    span = max(s.context + max(s.chunks) for s in steps)
    pages = pages_for(max(tokens, span), size)
    scratch = model.allocate_cache(pages + 1, size, c * (1 + config.spec_tokens),
                                   config.kv_dtype == "int8")
    warm_up(model, scratch, config, steps)
    # one segment of the step's tokens: no real step, but it bounds any step's activations
    prefill = StepBatch.build([Segment([0] * tokens, 0, range(pages), 0)], size, model.device)
    # the largest of each graphed kind bounds the others: decode at every request, each chunk
    shapes = graph_shapes(config)
    widest = {s.tokens_per_seq: s.num_seqs for s in sorted(shapes, key=lambda s: s.num_seqs)}
    graphed = [graph_example(s, config, model.device) for s in shapes
               if s.num_seqs == widest[s.tokens_per_seq]]
    peaks = []
    for batch in (prefill, *graphed):
        _forward_step(model, scratch, batch)  # what the warm-up did not tune happens here
        peaks.append(peak_bytes(lambda b=batch, s=scratch: _forward_step(model, s, b),
                                model.device))
    del scratch
    torch.cuda.empty_cache()
    return peaks[0], max(peaks[1:])


def plan_device_memory(model: Qwen3_5Model, config: EngineConfig,
                       draft_kv_bytes_per_token: int = 0) -> MemoryPlan:
    """The plan for the model already loaded (weights, draft models included, are what is
    allocated now); a speculative request holds 1 + K state slots, and a draft model's caches
    take `draft_kv_bytes_per_token` beside the target's KV."""
    device = model.device
    torch.cuda.empty_cache()
    prefill, graphed = measure_workspaces(model, config)
    free, total = torch.cuda.mem_get_info(device)
    ours = torch.cuda.memory_reserved(device)
    kv_bytes = kv_bytes_per_token(model.config, config.kv_dtype, model.dtype)
    plan = plan_memory(
        device=str(device), total=total, other=total - free - ours,
        weights=torch.cuda.memory_allocated(device),
        state_slots=config.max_concurrency * (1 + config.spec_tokens)
        * state_bytes_per_slot(model),
        # the measured step starts at position 0; a chunk after cached context may also hold
        # its whole context gathered (ops.attention.gathered_context_attention)
        prefill_workspace=prefill + lone_prompt_gather_bytes(
            config.max_context, config.page_size, model.config.num_key_value_heads,
            model.config.head_dim, device),
        step_tokens=config.step_tokens, graph_workspace=graphed,
        kv_bytes_per_token=kv_bytes + draft_kv_bytes_per_token,
        page_size=config.page_size, max_context=config.max_context,
        max_concurrency=config.max_concurrency, kv_capacity=config.kv_capacity,
        use_cuda_graphs=config.cuda_graphs, spec_tokens=config.spec_tokens)
    log.info("%s", plan.table())
    return plan


def warm_up_proposer(proposer: Proposer, model: Qwen3_5Model, config: EngineConfig,
                     steps: Sequence[WarmupStep], num_pages: int) -> None:
    """The proposer's passes over the rows of every warm-up step, before its graphs are
    captured: in a round with prompt chunks its first pass (MTP) or context injection (DFlash)
    runs eagerly over whatever rows the step had. On its own caches, allocated but not yet used
    by any request (each writes its positions before it reads them); a step needing more than
    their `num_pages` pages cannot occur."""
    k, h = config.spec_tokens, model.config.hidden_size
    start, ran = time.perf_counter(), 0
    for step in steps:
        rows = [k + 1] * step.num_seqs if step.decode else step.chunks
        # drafting writes up to K + 1 positions past a decode-ready request's rows; a decode
        # step's context only times attention configs, so it is dropped where it won't fit
        context = step.context
        if step.decode and pages_for(context + max(rows) + k + 1, config.page_size) > num_pages:
            context = 0
        pages = range(pages_for(context + max(rows) + k + 1, config.page_size))
        if len(pages) > num_pages:
            continue
        starts = [0, *accumulate(rows)]
        committed = [Committed(f"warm-up-{i}", range(starts[i], starts[i + 1]), context,
                               [0] * n, pages, propose=step.decode)
                     for i, n in enumerate(rows)]
        hidden = torch.zeros(starts[-1], h, dtype=model.dtype, device=model.device)
        taps = hidden.new_zeros(starts[-1], len(proposer.taps) * h) if proposer.taps else None
        with warming_up():
            proposer.propose(hidden, taps, committed)
        ran += 1
    _synchronize(model.device)
    log.info("proposer warm-up: %d step shapes in %.1f s", ran, time.perf_counter() - start)


def step_graphs(model: Qwen3_5Model, caches: list[LayerCache], config: EngineConfig,
                taps: Sequence[int] = (), *, capture: bool = True) -> StepGraphs:
    """Graphs of the target's step (forward + lm_head, and the taps a proposer reads) for
    every shape of `graph_shapes` (capture=False: their static buffers, run eagerly, as the
    CPU tests use them).

    Capture runs real steps on position 0 of page 0 and slots no request holds yet: harmless,
    since a request's pages and slots are written before they are read.
    """
    graphs = StepGraphs(lambda b: _forward_step(model, caches, b, taps),
                        lambda shape: graph_example(shape, config, model.device),
                        max_pages=request_pages(config), capture=capture)
    before = torch.cuda.memory_allocated(model.device) if capture else 0
    graphs.capture_all(graph_shapes(config))
    if capture:
        log.info("captured %d step graphs (%s): %.2f GiB", len(graphs.shapes),
                 ", ".join(f"{s.num_seqs}x{s.tokens_per_seq}" for s in graphs.shapes),
                 (torch.cuda.memory_allocated(model.device) - before) / 2**30)
    return graphs
