"""Paged attention and the fused KV store on the real attention shapes.

27B: 24 q / 4 kv heads, 35B-A3B: 16 q / 2 kv heads; head_dim 256, 64-token pages, INT8 KV with
one fp16 scale per 64 elements (the engine's default). Decode is memory-bound: its ratio is KV
bytes read (plus q/out) over the copy bandwidth. A prompt chunk is compute-bound: its ratio is
attention FLOPs (4 * d per visible query-key pair and q head) over the bf16 tensor-core rate.

Timing replays a CUDA graph (as the engine runs its steps) of several copies of the call on
separate data, after do_bench has flushed the L2, so every copy reads its KV from HBM and short
calls are not hidden behind Python launch overhead; the row reports the time of one copy.
Pages are handed out shuffled, as a long-running pool would, and the cache holds random data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from unittest.mock import patch

import torch

from ninfer_bench.ceilings import against_bandwidth, against_flops

PAGE_SIZE = 64
HEAD_DIM = 256
SHAPES = {"27b": (24, 4), "35b_a3b": (16, 2)}  # q heads, kv heads
COPIES_BYTES = 256 << 20  # copies of a small call per graph: up to this much data in all
MAX_COPIES = 8

Call = Callable[[], object]


def _kv_bytes(tokens: int, nkv: int, int8: bool) -> int:
    """K + V bytes of `tokens` tokens of one layer (scales included)."""
    per_head = HEAD_DIM + HEAD_DIM // 64 * 2 if int8 else HEAD_DIM * 2
    return 2 * tokens * nkv * per_head


def _copies(bytes_per_call: int) -> int:
    return max(1, min(MAX_COPIES, COPIES_BYTES // bytes_per_call))


def _caches(pages: int, nkv: int, int8: bool, device: str) -> list[torch.Tensor | None]:
    shape = (pages, PAGE_SIZE, nkv, HEAD_DIM)
    if not int8:
        return [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(2)] + [
            None, None]
    kv = [torch.randint(-127, 128, shape, device=device, dtype=torch.int8) for _ in range(2)]
    scales = [torch.rand((*shape[:3], HEAD_DIM // 64), device=device).mul_(0.02).half()
              for _ in range(2)]
    return kv + scales


def _time_us(calls: list[Call]) -> float:
    """Median microseconds of one of `calls` (same work, different data) from graph replays."""
    import triton

    for call in calls:  # compile and autotune before capturing
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    return ms * 1e3 / len(calls)


def _attention_call(model: str, query_lens: list[int], context: int, int8: bool,
                    device: str) -> Call:
    """A step of len(query_lens) sequences, each with `context` tokens cached once stored
    (its queries the last ones)."""
    from ninfer_runtime.ops.attention import paged_attention

    nq, nkv = SHAPES[model]
    batch, per_seq = len(query_lens), -(-context // PAGE_SIZE)
    caches = _caches(batch * per_seq, nkv, int8, device)
    tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq)
    q = torch.randn(sum(query_lens), nq, HEAD_DIM, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device=device)
    lens = torch.full((batch,), context, device=device)
    return lambda: paged_attention(q, *caches, tables, cu, lens, HEAD_DIM**-0.5)


def _decode_row(model: str, batch: int, context: int, int8: bool, device: str) -> dict:
    nq, nkv = SHAPES[model]
    moved = batch * _kv_bytes(context, nkv, int8) + 2 * batch * nq * HEAD_DIM * 2
    calls = [_attention_call(model, [1] * batch, context, int8, device)
             for _ in range(_copies(moved))]
    us = _time_us(calls)
    return {"op": f"paged_attention decode {model} {'int8' if int8 else 'bf16'} kv",
            "shape": f"B={batch} ctx={context}", "time_us": us, "bytes": moved,
            **against_bandwidth(moved, us)}


def _prefill_row(model: str, chunk: int, context: int, int8: bool, device: str,
                 block_m: int | None = None, ptx: bool = True) -> dict:
    """block_m: the prompt tiles' rows instead of ops.attention.PREFILL_BLOCK_M (64: half
    the registers, two programs an SM, twice the KV tiles decoded per query); not ptx: INT8
    tiles dequantized in fp32 (I2F) instead of by ops.attention.KV_DEQUANT_ASM's PTX."""
    from ninfer_runtime.ops import attention

    nq, nkv = SHAPES[model]
    moved = _kv_bytes(context, nkv, int8) + 2 * chunk * nq * HEAD_DIM * 2
    with patch.multiple(attention, PREFILL_BLOCK_M=block_m or attention.PREFILL_BLOCK_M,
                        KV_DEQUANT_ASM=ptx and attention.KV_DEQUANT_ASM):
        calls = [_attention_call(model, [chunk], context, int8, device)
                 for _ in range(_copies(moved))]
        us = _time_us(calls)
    variant = (f", {block_m}-row tiles" if block_m else "") + ("" if ptx else ", fp32 dequant")
    return _flops_row(f"paged_attention prefill {model} {'int8' if int8 else 'bf16'} kv{variant}",
                      model, chunk, context, us)


def _flops_row(op: str, model: str, chunk: int, context: int, us: float) -> dict:
    visible = chunk * (context - chunk) + chunk * (chunk + 1) // 2  # causal query-key pairs
    flops = 4 * HEAD_DIM * SHAPES[model][0] * visible
    return {"op": op, "shape": f"chunk={chunk} ctx={context}", "time_us": us, "flops": flops,
            **against_flops(flops, us)}


def _sdpa_row(model: str, tokens: int, device: str) -> dict:
    """torch's fused attention (its flash kernel where it takes GQA) on a lone prompt's bf16
    K/V, contiguous, causal: what a prompt step's attention costs outside the paged INT8
    kernel, for comparison."""
    import torch.nn.functional as F

    nq, nkv = SHAPES[model]
    q = torch.randn(1, nq, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, nkv, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    us = _time_us([lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                          enable_gqa=True)])
    return _flops_row(f"torch sdpa prefill {model} bf16 kv", model, tokens, tokens, us)


def _lone_prompt_call(model: str, chunk: int, context: int, device: str,
                      path: Callable[..., torch.Tensor]) -> Call:
    """One of the engine's paths for a lone prompt chunk, the last `chunk` of `context` tokens
    cached on shuffled INT8 pages, gated: `path(q, caches..., pages, context, cu, lens,
    scale, gate)`."""
    nq, nkv = SHAPES[model]
    pages = -(-context // PAGE_SIZE)
    caches = _caches(pages, nkv, True, device)
    table = torch.randperm(pages, device=device)
    q, gate = (torch.randn(chunk, nq, HEAD_DIM, device=device, dtype=torch.bfloat16)
               for _ in range(2))
    cu = torch.tensor([0, chunk], device=device)
    lens = torch.tensor([context], device=device)
    return lambda: path(q, *caches, table, context, cu, lens, HEAD_DIM**-0.5, gate)


def _fresh_row(model: str, tokens: int, device: str) -> dict:
    """The engine's path for a lone prompt from position 0 (`fresh_prompt_attention`): its
    INT8 pages gathered and dequantized, then torch's fused attention, with the output gate;
    beside the paged kernel's row of the same prompt it sets FRESH_PROMPT_MIN_TOKENS."""
    from ninfer_runtime.ops.attention import fresh_prompt_attention

    nq, nkv = SHAPES[model]
    moved = _kv_bytes(tokens, nkv, True) + 3 * tokens * nq * HEAD_DIM * 2

    def fresh(q, k, v, ks, vs, table, context, cu, lens, scale, gate):
        return fresh_prompt_attention(q, k, v, ks, vs, table, scale, gate)

    us = _time_us([_lone_prompt_call(model, tokens, tokens, device, fresh)
                   for _ in range(_copies(moved))])
    return _flops_row(f"fresh prompt {model} int8 kv (gathered, torch fused attention)", model,
                      tokens, tokens, us)


def _gathered_row(model: str, chunk: int, context: int, device: str) -> dict:
    """The engine's path for a lone prompt chunk after cached context
    (`gathered_context_attention`): the context's INT8 pages gathered into fp16 pages, then
    the paged kernel unquantized, gated; beside the paged INT8 kernel's row of the same
    chunk."""
    from ninfer_runtime.ops.attention import gathered_context_attention

    nq, nkv = SHAPES[model]
    moved = _kv_bytes(context, nkv, True) + 3 * chunk * nq * HEAD_DIM * 2
    us = _time_us([_lone_prompt_call(model, chunk, context, device, gathered_context_attention)
                   for _ in range(_copies(moved))])
    return _flops_row(f"gathered context {model} int8 kv (fp16 pages, paged kernel)", model,
                      chunk, context, us)


def _store_call(model: str, tokens: int, device: str) -> Call:
    from ninfer_runtime.ops.attention import store_kv

    _, nkv = SHAPES[model]
    pages = -(-tokens // PAGE_SIZE)
    caches = _caches(pages, nkv, True, device)
    k, v = (torch.randn(tokens, nkv, HEAD_DIM, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    slots = torch.randperm(pages * PAGE_SIZE, device=device)[:tokens]
    return lambda: store_kv(k, v, *caches, slots)


def _store_row(model: str, tokens: int, device: str) -> dict:
    _, nkv = SHAPES[model]
    moved = 2 * tokens * nkv * HEAD_DIM * 2 + _kv_bytes(tokens, nkv, True) + tokens * 8
    us = _time_us([_store_call(model, tokens, device) for _ in range(_copies(moved))])
    return {"op": f"store_kv {model} int8", "shape": f"N={tokens}", "time_us": us,
            "bytes": moved, **against_bandwidth(moved, us)}


def bench(device: str = "cuda") -> Iterator[dict]:
    """A lone prompt of 2K-8K tokens in one step through the paged kernel and the engine's
    fresh-prompt path (at 8K also bf16 KV, INT8 in 64-row tiles and dequantized in fp32, and
    torch's fused attention on bf16 K/V alone), a 1024-token prompt chunk over 8K, an 8K chunk
    over 16K and 32K through the paged kernel and the gathered-context path, decode at
    8K/64K/128K context (batch 1 and 8), and the KV store for a decode step and a prompt
    chunk, each row as it is measured."""
    for model in SHAPES:
        for tokens in (2048, 4096, 8192):
            yield _prefill_row(model, tokens, tokens, True, device)
            yield _fresh_row(model, tokens, device)
        yield _prefill_row(model, 8192, 8192, False, device)
        yield _prefill_row(model, 8192, 8192, True, device, ptx=False)
        yield _prefill_row(model, 8192, 8192, True, device, block_m=64)
        yield _sdpa_row(model, 8192, device)
    yield _prefill_row("27b", 1024, 8192, True, device)
    for context in (16384, 32768):
        yield _prefill_row("27b", 8192, context, True, device)
        yield _gathered_row("27b", 8192, context, device)
    yield from (_decode_row("27b", batch, context, True, device)
                for batch in (1, 8) for context in (8192, 65536, 131072))
    yield _decode_row("27b", 1, 65536, False, device)
    yield from (_decode_row("35b_a3b", batch, 65536, True, device) for batch in (1, 8))
    yield from (_store_row("27b", tokens, device) for tokens in (8, 8192))
