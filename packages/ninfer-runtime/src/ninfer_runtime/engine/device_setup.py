"""What the engine does once on a GPU before serving: plan the memory, capture the graphs.

The plan needs two numbers only a run can tell: the peak activations of the largest step the
scheduler can build (every running request prefilling a full chunk) and of a full decode step.
Both are measured on a scratch cache that is freed again before the real KV pool is allocated;
the second of two runs is measured, so that Triton's autotuning (which allocates benchmark
buffers on a kernel's first call) is not counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ninfer_runtime.config import FULL_ATTENTION
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.cuda_graph import GraphShape, StepGraphs
from ninfer_runtime.engine.kv_pool import kv_bytes_per_token, pages_for, request_pages
from ninfer_runtime.engine.memory_plan import MemoryPlan, peak_bytes, plan_memory
from ninfer_runtime.models.cache import GDNSlots, LayerCache, allocate_layer_caches
from ninfer_runtime.models.qwen3_5 import Qwen3_5Model

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
    logits = model.logits(hidden[batch.logits_rows])
    return (hidden, logits, tapped) if taps else (hidden, logits)


def decode_batch(num_seqs: int, config: EngineConfig, page: int, device: torch.device
                 ) -> StepBatch:
    """A step of `num_seqs` decode-ready requests at position 0 of `page`, in state slots
    0..num_seqs-1: one token each, or with spec a verify segment of K+1 tokens whose
    snapshot slots lie beyond the first max_concurrency."""
    k, c = config.spec_tokens, config.max_concurrency
    return StepBatch.build(
        [Segment([0] * (k + 1), 0, [page], b, "all" if k else "last",
                 [*range(c + b * k, c + (b + 1) * k), b] if k else None)
         for b in range(num_seqs)], config.page_size, device)


def measure_workspaces(model: Qwen3_5Model, config: EngineConfig) -> tuple[int, int]:
    """Peak activation bytes of (the largest prefill step, a full decode or verify step)."""
    size, c = config.page_size, config.max_concurrency
    tokens = c * min(config.prefill_chunk, config.max_context)
    pages = pages_for(tokens, size)
    scratch = model.allocate_cache(pages + 1, size, c * (1 + config.spec_tokens),
                                   config.kv_dtype == "int8")
    prefill = StepBatch.build([Segment([0] * tokens, 0, range(pages), 0)], size, model.device)
    decode = decode_batch(c, config, pages, model.device)
    peaks = []
    for batch in (prefill, decode):
        _forward_step(model, scratch, batch)  # autotuning happens here
        peaks.append(peak_bytes(lambda b=batch, s=scratch: _forward_step(model, s, b),
                                model.device))
    del scratch
    torch.cuda.empty_cache()
    return peaks[0], peaks[1]


def plan_device_memory(model: Qwen3_5Model, config: EngineConfig,
                       draft_kv_bytes_per_token: int = 0) -> MemoryPlan:
    """The plan for the model already loaded (weights, draft models included, are what is
    allocated now); a speculative request holds 1 + K state slots, and a draft model's caches
    take `draft_kv_bytes_per_token` beside the target's KV."""
    device = model.device
    torch.cuda.empty_cache()
    prefill, decode = measure_workspaces(model, config)
    free, total = torch.cuda.mem_get_info(device)
    ours = torch.cuda.memory_reserved(device)
    kv_bytes = kv_bytes_per_token(model.config, config.kv_dtype, model.dtype)
    plan = plan_memory(
        device=str(device), total=total, other=total - free - ours,
        weights=torch.cuda.memory_allocated(device),
        state_slots=config.max_concurrency * (1 + config.spec_tokens)
        * state_bytes_per_slot(model),
        prefill_workspace=prefill, decode_workspace=decode,
        kv_bytes_per_token=kv_bytes + draft_kv_bytes_per_token,
        page_size=config.page_size, max_context=config.max_context,
        max_concurrency=config.max_concurrency, kv_capacity=config.kv_capacity,
        use_cuda_graphs=config.cuda_graphs, spec_tokens=config.spec_tokens)
    log.info("%s", plan.table())
    return plan


def decode_graphs(model: Qwen3_5Model, caches: list[LayerCache], config: EngineConfig,
                  taps: Sequence[int] = ()) -> StepGraphs:
    """Graphs of the decode step (forward + lm_head, and the taps a proposer reads) at every
    batch size 1..max_concurrency: one token per request, or with spec the verify step of
    K+1 tokens.

    Capture runs real steps on position 0 of page 0 and slots no request holds yet: harmless,
    since a request's pages and slots are written before they are read.
    """
    k = config.spec_tokens
    before = torch.cuda.memory_allocated(model.device)
    graphs = StepGraphs(lambda b: _forward_step(model, caches, b, taps),
                        lambda n, _: decode_batch(n, config, 0, model.device),
                        max_pages=request_pages(config))
    graphs.capture_all(GraphShape(b, k + 1) for b in range(1, config.max_concurrency + 1))
    log.info("captured %d %s graphs (batch 1..%d): %.2f GiB", len(graphs.shapes),
             "verify" if k else "decode", config.max_concurrency,
             (torch.cuda.memory_allocated(model.device) - before) / 2**30)
    return graphs
