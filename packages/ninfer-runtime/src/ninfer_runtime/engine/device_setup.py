"""What the engine does once on a GPU before serving: plan the memory, capture the graphs.

The plan needs two numbers only a run can tell: the peak activations of the largest step the
scheduler can build (every running request prefilling a full chunk) and of a full decode step.
Both are measured on a scratch cache that is freed again before the real KV pool is allocated;
the second of two runs is measured, so that Triton's autotuning (which allocates benchmark
buffers on a kernel's first call) is not counted.
"""

from __future__ import annotations

import logging

import torch

from ninfer_runtime.config import FULL_ATTENTION
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.cuda_graph import GraphShape, StepGraphs
from ninfer_runtime.engine.kv_pool import kv_bytes_per_token, pages_for
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


def _forward_step(model: Qwen3_5Model, caches: list[LayerCache], batch: StepBatch
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = model.forward_batch(batch, caches)
    return hidden, model.logits(hidden[batch.logits_rows])


def measure_workspaces(model: Qwen3_5Model, config: EngineConfig) -> tuple[int, int]:
    """Peak activation bytes of (the largest prefill step, a full decode step)."""
    size, c = config.page_size, config.max_concurrency
    tokens = c * min(config.prefill_chunk, config.max_context)
    pages = pages_for(tokens, size)
    scratch = model.allocate_cache(pages + c, size, c, config.kv_dtype == "int8")
    prefill = StepBatch.build([Segment([0] * tokens, 0, range(pages), 0)], size, model.device)
    decode = StepBatch.build([Segment([0], 0, [pages + b], b) for b in range(c)], size,
                             model.device)
    peaks = []
    for batch in (prefill, decode):
        _forward_step(model, scratch, batch)  # autotuning happens here
        peaks.append(peak_bytes(lambda b=batch, s=scratch: _forward_step(model, s, b),
                                model.device))
    del scratch
    torch.cuda.empty_cache()
    return peaks[0], peaks[1]


def plan_device_memory(model: Qwen3_5Model, config: EngineConfig) -> MemoryPlan:
    device = model.device
    torch.cuda.empty_cache()
    prefill, decode = measure_workspaces(model, config)
    free, total = torch.cuda.mem_get_info(device)
    ours = torch.cuda.memory_reserved(device)
    plan = plan_memory(
        device=str(device), total=total, other=total - free - ours,
        weights=torch.cuda.memory_allocated(device),
        state_slots=config.max_concurrency * state_bytes_per_slot(model),
        prefill_workspace=prefill, decode_workspace=decode,
        kv_bytes_per_token=kv_bytes_per_token(model.config, config.kv_dtype, model.dtype),
        page_size=config.page_size, max_context=config.max_context,
        max_concurrency=config.max_concurrency, kv_capacity=config.kv_capacity,
        use_cuda_graphs=config.cuda_graphs)
    log.info("%s", plan.table())
    return plan


def decode_graphs(model: Qwen3_5Model, caches: list[LayerCache],
                  config: EngineConfig) -> StepGraphs:
    """Graphs of the decode step (forward + lm_head) at every batch size 1..max_concurrency.

    Capture runs real steps on position 0 of page 0 and slots 0..C-1: harmless, since no
    request holds them yet and a request's pages and slot are written before they are read.
    """
    size = config.page_size

    def example(num_seqs: int, tokens: int) -> StepBatch:
        return StepBatch.build([Segment([0] * tokens, 0, [0], b) for b in range(num_seqs)],
                               size, model.device)

    before = torch.cuda.memory_allocated(model.device)
    graphs = StepGraphs(lambda b: _forward_step(model, caches, b), example,
                        max_pages=pages_for(config.max_context, size))
    graphs.capture_all(GraphShape(b, 1) for b in range(1, config.max_concurrency + 1))
    log.info("captured %d decode graphs (batch 1..%d): %.2f GiB", len(graphs.shapes),
             config.max_concurrency, (torch.cuda.memory_allocated(model.device) - before) / 2**30)
    return graphs
