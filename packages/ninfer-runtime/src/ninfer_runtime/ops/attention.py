"""Attention over a paged KV cache: storing new keys/values, and GQA attention (causal by
default; non-causal and sliding-window for the DFlash draft).

The cache of one full-attention layer is two tensors [num_pages, page_size, nkv, head_dim]
(K and V), either unquantized (the compute dtype) or int8 with fp16 scales
[num_pages, page_size, nkv, head_dim // group] (ops.kv_quant). A sequence owns a list of pages
(its page table row); its token at position p lives in page page_table[p // page_size] at
offset p % page_size. The flat slot of a token is page * page_size + offset.

The sigmoid output gate of Qwen3.5's gated attention is an elementwise multiply on the output:
`paged_attention` applies it when given (`gate`), which the kernel does in its epilogue for free.

Visibility (`visible_keys`): a query at position p sees key position n when n <= p (causal) or
any stored n (non-causal: the DFlash draft's block queries see the whole block), and with a
window w only keys with p - n < w (and n - p < w when non-causal: z-lab's reference mask).

Kernels (CUDA, or NINFER_OPS=triton): `store_kv` quantizes and scatters every token's K and V in
one launch. `paged_attention` is one FlashAttention-2-style kernel for decode rows, prompt chunks
and mixed batches: a program takes a block of query tokens of one sequence times all q heads
of one kv head (GQA packed into the rows, so each K/V tile is read and dequantized once for
the group), walks that sequence's pages in tiles with an online softmax, and dequantizes int8
tiles in registers. When the grid would be too small to fill the GPU (decode, short chunks),
each block's context is split over several programs (flash-decoding) whose partial results a
second kernel merges; at decode the merge also writes o_proj's activation operand (the
decode GEMV's input, `paged_attention_with_operand`), so that GEMV launches no pass of its own.
A long prompt from position 0 (`fresh_prompt_attention`) instead gathers its own pages once and
runs torch's fused attention on them: there is no cached context for the pages to serve. A long
chunk after cached context (`gathered_context_attention`) gathers that context once into fp16
pages and runs the paged kernel unquantized on them: every tile of the chunk reads all of it.
Launch shapes depend only on tensor shapes (nothing is read back to the host), so both kernels
can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from ninfer_runtime.ops.compile_ahead import launch
from ninfer_runtime.ops.dispatch import INTERPRET, runs_triton_on, use_triton
from ninfer_runtime.ops.kv_quant import dequantize_int8, quantize_int8
from ninfer_runtime.ops.launch import dot_precision, options
from ninfer_runtime.ops.quant_linear import DecodeOperand, operand_buffers
from ninfer_runtime.ops.varlen import num_blocks

try:
    import triton
    import triton.language as tl

    from ninfer_runtime.ops.kv_quant import dequantize_int8_words, quantize_int8_tile
    from ninfer_runtime.ops.quant_decode import store_operand
    from ninfer_runtime.ops.varlen import block_of
except ImportError:  # the torch references need no Triton
    triton = None

LOG2E = 1.4426950408889634
# Rows of a decode tile: one token's q heads of a kv head (6 on the 27B, 8 on the 35B-A3B),
# padded to a power of two. tl.dot pads fewer than 16 rows to the MMA's 16 itself (Triton 3.6
# and later), and 8 rows halve what the tile holds and reloads of q every iteration: sm_90
# SASS (Triton 3.6, the 27B's decode tile, BLOCK_N 16, 4 warps, prefetching) 470 loop
# instructions and 128 registers (4 programs an SM) against 16 rows' 512 and 168 (3);
# untimed. NINFER_ATTN_DECODE_ROWS=16 restores the 16-row tile for the A/B.
DECODE_BLOCK_M = int(os.environ.get("NINFER_ATTN_DECODE_ROWS", "8"))
if DECODE_BLOCK_M < 1 or DECODE_BLOCK_M & (DECODE_BLOCK_M - 1):
    raise ValueError(f"NINFER_ATTN_DECODE_ROWS={DECODE_BLOCK_M}: expected a power of two")
# tiles that take the prefetching candidates: decode rows and short verify segments (prompt
# tiles are compute-bound and short of registers)
PREFETCH_MAX_BLOCK_M = 16
PREFILL_BLOCK_M = 128  # rows (tokens x q heads of a kv head) per program for prompt chunks
# Context splits per query block (a power of two), and the fewest keys a split takes (fewer
# cost more in merging than they save). One sequence's decode has 64 splits a kv head; with a
# floor of 256 keys only 32 of them worked at 8K (128 programs, one an SM for the config the
# tuner picked there, 8 warps at 149 registers), while from 16K on all 64 do, twice the
# programs under the config tuned at 8K: two waves. A floor of 128 keeps 8K and every longer
# context at the same working grid: +0.4% on the H100's 27B (docs/perf.md, thirty-second run;
# 128 splits of 64 keys lost 0.8%). NINFER_ATTN_MAX_SPLITS and NINFER_ATTN_MIN_SPLIT override
# both for timing them.
MAX_SPLITS = int(os.environ.get("NINFER_ATTN_MAX_SPLITS", "64"))
MIN_SPLIT_TOKENS = int(os.environ.get("NINFER_ATTN_MIN_SPLIT", "128"))
WAVES = 2  # programs to aim for, per multiprocessor, before splitting stops
MERGE_PARTIALS = 32  # partial outputs (heads x splits) one merge program combines, at most
# splits a merge program loads in one round (64 x 256 values a head: 99 registers at 8 warps,
# sm_90; more split counts, as NINFER_ATTN_MAX_SPLITS may set, take more rounds)
MERGE_SPLITS_AT_ONCE = 64
# INT8 KV dequantized by inline PTX in fp16 (kv_quant.INT8_WORD_PTX), four codes an
# instruction, the dots then in fp16. The fp32 path converts every code with I2F and rounds
# pairs to bf16 with F2FP, conversions that Hopper issues at a fraction of the FP32 rate
# (Triton took its own s8 -> bf16 cast off them for that reason, triton-lang/triton#4563): a
# prompt tile's loop (BLOCK_M 128, BLOCK_N 64, 8 warps, sm_90 SASS) has 128 I2F and 80 F2FP a
# thread an iteration among 931 instructions; with the PTX, 747 and neither (16 spill loads an
# iteration at BLOCK_N 64, none at 32 or 16: the tuner picks). Decode loops: 5.9 instead of
# 6.8 instructions per KV element (BLOCK_N 32, 4 warps). Not for fp32 queries or the
# interpreter (which cannot run PTX). The codes are loaded as the 32-bit words that hold four
# of them, as the PTX takes them: loaded as int8, Triton unpacked each word into bytes and
# packed them back (sm_90, Triton 3.6, the decode tiles' loops: 587 -> 514 instructions at
# BLOCK_N 16 with 4 warps, 621 -> 520 at BLOCK_N 32 with 8, 787 -> 550 and 179 -> 128
# registers without prefetching; the prompt tiles' as before).
KV_DEQUANT_ASM = not INTERPRET


def visible_keys(t: int, s: int, *, causal: bool = True, window: int | None = None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """[t, s] bool, True where query i (at position s - t + i) may attend to key position n."""
    pos = torch.arange(s - t, s, device=device)[:, None]
    n = torch.arange(s, device=device)[None, :]
    mask = torch.ones(t, s, dtype=torch.bool, device=device)
    if causal:
        mask &= n <= pos
    if window is not None:
        mask &= pos - n < window
        if not causal:
            mask &= n - pos < window
    return mask


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                     causal: bool = True, window: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with GQA, for one sequence (causal by default).

    q [T, nq, d] are the queries of the last T positions of a sequence whose keys and values
    (including those T positions) are k, v [S, nkv, d], S >= T: query i sits at position
    S - T + i and sees keys 0 .. S - T + i (see `visible_keys` for `causal` and `window`).
    Query head h reads kv head h // (nq // nkv). Returns [T, nq, d] in q.dtype.
    """
    t, s = q.shape[0], k.shape[0]
    if s < t:
        raise ValueError(f"{t} queries need at least as many cached keys, got {s}")
    # [heads, len, d] for SDPA; the mask is True where attention is allowed.
    mask = None
    if (t > 1 and causal) or window is not None:
        mask = visible_keys(t, s, causal=causal, window=window, device=q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


@dataclass(frozen=True)
class KVStore:
    """Where a step's keys and values go: the paged caches [pages, page_size, nkv, d], their
    int8 group scales (None for bf16 caches) and each token's flat slot (`store_kv`'s
    arguments; ops.rope.qk_norm_rope_store writes there in its own launch)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    slot_mapping: torch.Tensor

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        store_kv(k, v, self.k_cache, self.v_cache, self.k_scale, self.v_scale,
                 self.slot_mapping)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
             slot_mapping: torch.Tensor) -> None:
    """Writes k, v [N, nkv, d] into the caches at the flat slots slot_mapping [N] (int64).

    With scales (int8 caches) the values are quantized per group on the way in. The kernel
    skips negative slots (padding rows of a captured graph); the reference takes none.
    """
    if use_triton(k, v, k_cache, slot_mapping) and k.shape[-1] == _pow2(k.shape[-1]):
        _store_kv_triton(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return
    store_kv_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
    """The torch reference of `store_kv`."""
    for x, cache_, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache_.view(-1, *cache_.shape[2:])  # [num_pages * page_size, nkv, d]
        if scales is None:
            flat.index_copy_(0, slot_mapping, x.to(cache_.dtype))
            continue
        q, s = quantize_int8(x, cache_.shape[-1] // scales.shape[-1])
        flat.index_copy_(0, slot_mapping, q)
        scales.view(-1, *scales.shape[2:]).index_copy_(0, slot_mapping, s)


def gather_kv(cache: torch.Tensor, scales: torch.Tensor | None, pages: torch.Tensor,
              length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `length` tokens stored in `pages` (one sequence's page table): [length, nkv, d]
    in `dtype`, dequantized when the cache is int8."""
    x = cache[pages].flatten(0, 1)[:length]
    if scales is None:
        return x.to(dtype)
    return dequantize_int8(x, scales[pages].flatten(0, 1)[:length], dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    page_tables: torch.Tensor, cu_seqlens: torch.Tensor,
                    context_lens: torch.Tensor, scale: float,
                    gate: torch.Tensor | None = None, *, causal: bool = True,
                    window: int | None = None) -> torch.Tensor:
    """Attention of B sequences' new queries over their paged keys and values.

    q [N, nq, d] holds the sequences' queries back to back: sequence b owns rows
    cu_seqlens[b] .. cu_seqlens[b+1] ([B+1]), the last positions of its context_lens[b] ([B])
    tokens, whose K/V (these positions included) are already stored in the pages of
    page_tables[b] ([B, max_pages], unused entries arbitrary). With `gate` [N, nq, d] the
    result is multiplied by sigmoid(gate). `causal` and `window` as in `visible_keys`.
    Returns [N, nq, d] in q.dtype.
    """
    if window is not None and window < 1:
        raise ValueError(f"attention window {window} must be at least 1")
    if use_triton(q, k_cache, page_tables, cu_seqlens, context_lens) and _kernel_fits(q, k_cache):
        return _paged_attention_triton(q, k_cache, v_cache, k_scale, v_scale, page_tables,
                                       cu_seqlens, context_lens, scale, gate, causal=causal,
                                       window=window)[0]
    return paged_attention_ref(q, k_cache, v_cache, k_scale, v_scale, page_tables, cu_seqlens,
                               context_lens, scale, gate, causal=causal, window=window)


def paged_attention_with_operand(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                                 page_tables: torch.Tensor, cu_seqlens: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float,
                                 gate: torch.Tensor | None, spec: tuple[int, bool] | None,
                                 lone_context: int = 0
                                 ) -> tuple[torch.Tensor, DecodeOperand | None]:
    """`paged_attention` (causal, no window), and the decode operand of its result read as
    [N, nq * d] (o_proj's input) of `spec` (group, sums: ops.linear.decode_operand_spec of
    o_proj, or None), the bits o_proj's own activation pass would make. The split merge
    writes it, where the kernels run, the context is split and each head holds whole groups
    (d a multiple of the group); elsewhere it is None (o_proj makes its own).

    `lone_context` (host-side, engine.batch.StepBatch.lone_prompt_context): the step is one
    sequence's prompt chunk, and this its context once stored (0: any other step). A long
    chunk from position 0 takes `fresh_prompt_attention`, one after cached context
    `gathered_context_attention`."""
    path = _lone_prompt_path(q, k_cache, lone_context) if lone_context else None
    if path == "fresh":
        return fresh_prompt_attention(q, k_cache, v_cache, k_scale, v_scale, page_tables[0],
                                      scale, gate), None
    if path == "gathered":
        return gathered_context_attention(q, k_cache, v_cache, k_scale, v_scale, page_tables[0],
                                          lone_context, cu_seqlens, context_lens, scale,
                                          gate), None
    if (spec is None or q.shape[-1] % spec[0] != 0 or not _kernel_fits(q, k_cache)
            or not use_triton(q, k_cache, page_tables, cu_seqlens, context_lens)):
        return paged_attention(q, k_cache, v_cache, k_scale, v_scale, page_tables, cu_seqlens,
                               context_lens, scale, gate), None
    return _paged_attention_triton(q, k_cache, v_cache, k_scale, v_scale, page_tables,
                                   cu_seqlens, context_lens, scale, gate, operand_spec=spec)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                        page_tables: torch.Tensor, cu_seqlens: torch.Tensor,
                        context_lens: torch.Tensor, scale: float,
                        gate: torch.Tensor | None = None, *, causal: bool = True,
                        window: int | None = None) -> torch.Tensor:
    """The torch reference of `paged_attention`: gathers and dequantizes each sequence."""
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    # NOTE: the reference reads the segment bounds on the host (a sync on a GPU); the kernel
    # takes the tensors as they are.
    bounds, lengths = cu_seqlens.tolist(), context_lens.tolist()
    for b, length in enumerate(lengths):
        lo, hi = bounds[b], bounds[b + 1]
        pages = page_tables[b, :-(-length // page_size)]
        k = gather_kv(k_cache, k_scale, pages, length, q.dtype)
        v = gather_kv(v_cache, v_scale, pages, length, q.dtype)
        out[lo:hi] = causal_attention(q[lo:hi], k, v, scale, causal=causal, window=window)
    return out if gate is None else out * torch.sigmoid(gate)


# A lone prompt chunk of at least this many tokens takes a gathered path: from position 0
# `fresh_prompt_attention` (on the H100 a 27B layer's 2K / 8K prompt in 194 / 1,649 us against
# the paged INT8 kernel's 274 / 3,349), after cached context `gathered_context_attention` (an
# 8K chunk over 16K / 32K 1.63x / 1.70x the INT8 pages; docs/perf.md, nineteenth run). The
# bound is set by the prompt-chunk graphs' steps (engine.device_setup.PROMPT_GRAPH_MAX_TOKENS),
# which record the paged kernel, not by the rates. NINFER_FRESH_PROMPT=0 turns both paths off,
# for comparison.
FRESH_PROMPT_MIN_TOKENS = 2049
FRESH_BLOCK_T = 32  # tokens a program of the gather and output passes takes


def _lone_prompt_path(q: torch.Tensor, k_cache: torch.Tensor, context: int) -> str | None:
    """How `paged_attention_with_operand` runs a lone prompt chunk q [T, nq, d] whose context
    is `context` tokens, over caches like k_cache: "fresh" (from position 0, where on a GPU a
    fused attention kernel takes the shapes), "gathered" (after cached context, where the
    kernels run) or None (the paged kernel: too short, turned off, or the references' mode)."""
    if (q.shape[0] < FRESH_PROMPT_MIN_TOKENS or not use_triton(q, k_cache)
            or not gathered_paths_on()):
        return None
    if context == q.shape[0]:
        fused = not q.is_cuda or _fused_kernel_runs(q.device, _operand_dtype(q.dtype),
                                                    q.shape[1], k_cache.shape[2], q.shape[2])
        return "fresh" if fused else None
    return "gathered" if _kernel_fits(q, k_cache) else None


def gathered_paths_on() -> bool:
    """NINFER_FRESH_PROMPT (default 1): whether lone prompt chunks may take a gathered path."""
    return os.environ.get("NINFER_FRESH_PROMPT", "1") == "1"


def lone_prompt_gather_bytes(max_context: int, page_size: int, nkv: int, d: int,
                             device: torch.device) -> int:
    """The most `gathered_context_attention` holds at once: K and V of a whole context of
    `max_context` tokens (in whole pages) in fp16, or 0 where it never runs (the memory plan
    adds it to the prefill workspace, which measures a step from position 0)."""
    if not (gathered_paths_on() and runs_triton_on(torch.device(device))):
        return 0
    return 2 * -(-max_context // page_size) * page_size * nkv * d * 2


def fresh_prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                           pages: torch.Tensor, scale: float,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's prompt q [T, nq, d] from position 0: its own keys
    and values (stored in `pages`, its page table) are its whole context, so they are gathered
    once into contiguous tensors, dequantized as the reference does (in fp16 for half
    queries: q * s rounded once, the values the paged kernel's PTX makes), and attended by
    torch's fused kernel (on the GPU FlashAttention, memory-efficient or cuDNN, never the
    math fallback, whose scores an 8K prompt would hold in gigabytes). With `gate` the result
    is multiplied by sigmoid(gate) as the reference does. Returns [T, nq, d] in q.dtype.

    Where the kernels run, the gather writes each of K and V head-major in one pass and the
    output's layout change and gate are one more (torch's passes made fp32 temporaries: a
    27B layer's 8K prompt took 1,935 us with them, 1,649 with the kernels, beside 1,336 of
    torch's attention alone; docs/perf.md, eighteenth and nineteenth runs, H100)."""
    t, dtype = q.shape[0], _operand_dtype(q.dtype)
    used = pages[:-(-t // k_cache.shape[1])]
    kernels = use_triton(q, k_cache, pages)
    # [1, heads, T, d]: the fused kernels take 4-dimensional inputs only
    k, v = (_gathered_heads(cache, scales, used, t, dtype, kernels)[None]
            for cache, scales in ((k_cache, k_scale), (v_cache, v_scale)))
    with _fused_kernels(q.device):
        out = F.scaled_dot_product_attention(q.to(dtype).transpose(0, 1)[None], k, v,
                                             is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    if kernels:
        return _gated_output_triton(out[0], gate, q.dtype)
    result = torch.empty_like(q)
    result.copy_(out[0].transpose(0, 1))
    return result if gate is None else result.mul_(torch.sigmoid(gate))


def _gathered_heads(cache: torch.Tensor, scales: torch.Tensor | None, pages: torch.Tensor,
                    length: int, dtype: torch.dtype, kernel: bool) -> torch.Tensor:
    """`gather_kv` laid out head-major, [nkv, length, d]: with `kernel` one pass that writes
    it contiguous (`_gather_kv_kernel`), else a transposed view of the reference's."""
    if kernel:
        return _gather_kv_triton(cache, scales, pages, length, dtype, head_major=True)
    return gather_kv(cache, scales, pages, length, dtype).transpose(0, 1)


def gathered_context_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                               pages: torch.Tensor, context: int, cu_seqlens: torch.Tensor,
                               context_lens: torch.Tensor, scale: float,
                               gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's prompt chunk q [T, nq, d], the last T of its
    `context` tokens (cu_seqlens [0, T] and context_lens [context] on the device; `pages` its
    page table), over cached context.
    Every tile of a long chunk reads the whole context, so the context is gathered once into
    contiguous pages of fp16 K/V for half queries (dequantized as `fresh_prompt_attention`
    does) and the paged kernel runs unquantized on them: a 27B layer's 8K chunk over 16K /
    32K of context took 5.67 / 13.2 ms so against 9.22 / 22.4 over the INT8 pages
    (docs/perf.md, nineteenth run, H100). Returns [T, nq, d] in q.dtype."""
    page_size = k_cache.shape[1]
    used = pages[:-(-context // page_size)]
    dtype = _operand_dtype(q.dtype)
    # whole pages, so that every key row the kernel may load holds a finite value
    k, v = (_gather_kv_triton(cache, scales, used, used.shape[0] * page_size, dtype,
                              head_major=False).unflatten(0, (used.shape[0], page_size))
            for cache, scales in ((k_cache, k_scale), (v_cache, v_scale)))
    table = torch.arange(used.shape[0], device=q.device)[None]
    out, _ = _paged_attention_triton(q.to(dtype), k, v, None, None, table, cu_seqlens,
                                     context_lens, scale, gate, out_dtype=q.dtype)
    return out


def _operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a fresh prompt is attended in: fp16 for half models (INT8 K/V keep 11
    significant bits there, as in the paged kernel), the model's own otherwise."""
    return torch.float16 if dtype in (torch.float16, torch.bfloat16) else dtype


def _fused_kernels(device: torch.device):
    """A context that lets SDPA on `device` choose only fused kernels (any on the CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.CUDNN_ATTENTION])


@cache
def _fused_kernel_runs(device: torch.device, dtype: torch.dtype, nq: int, nkv: int,
                       d: int) -> bool:
    """torch's own test of whether a fused kernel takes causal GQA attention of these heads
    (asked of small tensors laid out as `fresh_prompt_attention`'s: what it checks is the
    dtype, the head sizes and the layout; the cuDNN test is missing from older torch)."""
    from torch.backends import cuda

    q = torch.empty((1, 64, nq, d), dtype=dtype, device=device).transpose(1, 2)
    k = torch.empty((1, 64, nkv, d), dtype=dtype, device=device).transpose(1, 2)
    params = cuda.SDPAParams(q, k, k, None, 0.0, True, nq != nkv)
    tests = ("can_use_flash_attention", "can_use_efficient_attention", "can_use_cudnn_attention")
    return any(getattr(cuda, name)(params) for name in tests if hasattr(cuda, name))


# --- Triton kernels -----------------------------------------------------------------------


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _kernel_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes the attention kernel takes (aranges need powers of two; tl.dot needs >= 16)."""
    d, nq, nkv = q.shape[-1], q.shape[1], k_cache.shape[2]
    return (d >= 16 and d == _pow2(d) and nq % nkv == 0
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32))


@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no parallelism to fill
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class _AttentionPlan:
    """How one paged_attention call is launched: rows per program, query tokens per program
    (block_q), programs along the token axis, and context splits per query block."""

    block_m: int
    block_q: int
    num_blocks: int
    num_splits: int


def launch_plan(num_tokens: int, num_seqs: int, group: int, nkv: int, num_sms: int,
                num_splits: int | None = None) -> _AttentionPlan:
    """Chooses the launch from shapes alone (no device read-back).

    A segment has at most num_tokens - num_seqs + 1 queries, so a pure decode step (N == B)
    gets one token per program in the smallest tile; query blocks are placed as in
    ops.varlen (exactly B blocks for decode). block_m and num_splits are part of the kernel's
    autotune key, so the engine's start-up warm-up (engine.warmup) enumerates them with this.
    """
    longest = num_tokens - num_seqs + 1
    block_m = max(DECODE_BLOCK_M, _pow2(group), min(PREFILL_BLOCK_M, _pow2(longest * group)))
    block_q = block_m // group
    blocks = num_blocks(num_tokens, num_seqs, block_q)
    if num_splits is None:
        num_splits = 1
        target = WAVES * num_sms
        while num_splits < MAX_SPLITS and blocks * nkv * num_splits < target:
            num_splits *= 2
    return _AttentionPlan(block_m, block_q, blocks, num_splits)


# (BLOCK_N, num_warps, num_stages, PREFETCH) candidates. Compiled offline for sm_90 (head_dim
# 256, INT8 KV) none spills registers on 16-row decode tiles; 128-row prompt tiles need 8 warps
# (with 4 they spill kilobytes), which _prune_configs enforces.
#
# PREFETCH (decode tiles only): the K and V tiles of the next iteration are loaded while this
# one computes. Triton's pipeliner does not stage these loads (their addresses come from the
# page table, loaded in the same iteration: the sm_90 build has 1 KB of shared memory and
# loads KV straight into registers), so without it every iteration waits out a global load
# latency, at one or two programs per SM. The H200 measured 15-28% of bandwidth for INT8 KV
# decode. In the sm_90 SASS (BLOCK_N 32, 8 warps) prefetching also changes how the tiles
# reach the MMA (ldmatrix instead of shared-memory loads per element): 565 instead of 711
# loop instructions, 146 registers instead of 141. At 4 warps it needs 242 registers, so the
# prefetching candidates are the ones that stay near 150, and both kinds are timed. PREFETCH 2
# loads two tiles ahead: twice the K/V bytes in flight a program where a long context's walk
# (4,096 keys a split at 256K) waits on them tile after tile; untimed.
_TUNE_SPACE = ((32, 8, 3, 0), (32, 4, 2, 0), (32, 4, 3, 0), (64, 8, 2, 0), (16, 8, 3, 0),
               (32, 8, 1, 1), (16, 4, 1, 1), (16, 8, 1, 1), (16, 4, 1, 2))


def _configs() -> list[triton.Config]:
    """Autotuning candidates; the interpreter gets one (it is slow and has nothing to tune)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 32, "PREFETCH": 0}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": n, "PREFETCH": f}, num_warps=w, num_stages=s)
            for n, w, s, f in _TUNE_SPACE]


def _prune_configs(configs: list[triton.Config], named_args: dict,
                   **kwargs: object) -> list[triton.Config]:
    """At least one warp per 16 rows of the tile (fewer run out of registers); prefetching
    only on decode tiles (prompt tiles are compute-bound and short of registers)."""
    block_m = kwargs["BLOCK_M"]
    kept = [c for c in configs if c.num_warps * 16 >= block_m
            and not (c.kwargs["PREFETCH"] and block_m > PREFETCH_MAX_BLOCK_M)]
    return kept or configs


if triton is not None:
    from ninfer_runtime.ops.launch import wait_for_inputs

    @triton.jit
    def store_token(x, stride_xt, stride_xh, cache_, scales, slot, t, num_heads,
                   HEADS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                   QUANT: tl.constexpr):
        """Token t's [heads, d] of x into `slot` of the cache (contiguous: slot stride is
        heads * d), quantized per group when QUANT."""
        h = tl.arange(0, HEADS)[:, None, None]
        d = tl.arange(0, GROUPS)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
        mask = h < num_heads
        val = tl.load(x + t * stride_xt + h * stride_xh + d, mask=mask, other=0.0)
        dst = cache_ + slot * num_heads * GROUPS * GROUP + h * GROUPS * GROUP + d
        if QUANT:
            qv, s = quantize_int8_tile(val.to(tl.float32))
            tl.store(dst, qv, mask=mask)
            g = tl.arange(0, GROUPS)[None, :]
            hh = tl.arange(0, HEADS)[:, None]
            tl.store(scales + slot * num_heads * GROUPS + hh * GROUPS + g, s, mask=hh < num_heads)
        else:
            tl.store(dst, val.to(cache_.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_kv_kernel(k, v, stride_kt, stride_kh, stride_vt, stride_vh,
                         k_cache, v_cache, k_scale, v_scale, slot_mapping, num_heads,
                         HEADS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                         QUANT: tl.constexpr, GDC: tl.constexpr):
        """One program per token: its K and V rows, all heads, into their slot."""
        wait_for_inputs(GDC)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping + t)
        if slot < 0:
            return
        store_token(k, stride_kt, stride_kh, k_cache, k_scale, slot, t, num_heads,
                   HEADS, GROUPS, GROUP, QUANT)
        store_token(v, stride_vt, stride_vh, v_cache, v_scale, slot, t, num_heads,
                   HEADS, GROUPS, GROUP, QUANT)

    @triton.jit
    def _kv_slots(page_row, n, kv_hi, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr = True):
        """(the flat cache slots of key positions n, which of them are < kv_hi); without
        MASKED the caller knows they all are (a constant mask, which the compiler drops)."""
        in_range = n < kv_hi if MASKED else tl.full(n.shape, True, tl.int1)
        page = tl.load(page_row + n // PAGE_SIZE, mask=in_range, other=0)
        return page * PAGE_SIZE + n % PAGE_SIZE, in_range

    @triton.jit
    def _kv_load(cache_, scales, slots, mask, head, num_heads, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr):
        """Head `head` of the tokens in `slots` [BLOCK_N] as stored (masked tokens read as 0):
        when QUANT its int8 codes as the 32-bit words that hold four of them, [BLOCK_N,
        groups, GROUP // 4], and their scales [BLOCK_N, groups] (`dequantize_int8_words`),
        else values [BLOCK_N, HEAD_DIM] (and a placeholder scale)."""
        GROUPS: tl.constexpr = HEAD_DIM // GROUP
        if QUANT:
            g = tl.arange(0, GROUPS)
            WORDS: tl.constexpr = GROUP // 4  # a group's words
            d = g[None, :, None] * WORDS + tl.arange(0, WORDS)[None, None, :]
            row = slots[:, None, None] * num_heads * (HEAD_DIM // 4) + head * (HEAD_DIM // 4)
            words = cache_.to(tl.pointer_type(tl.int32))
            x = tl.load(words + row + d, mask=mask[:, None, None], other=0)
            s = tl.load(scales + slots[:, None] * num_heads * GROUPS + head * GROUPS
                        + g[None, :], mask=mask[:, None], other=0.0)
        else:
            d = tl.arange(0, HEAD_DIM)
            x = tl.load(cache_ + slots[:, None] * num_heads * HEAD_DIM + head * HEAD_DIM
                        + d[None, :], mask=mask[:, None], other=0.0)
            s = 0.0
        return x, s

    @triton.jit
    def _kv_tiles(page_row, start, kv_hi, k_cache, v_cache, k_scale, v_scale, head, num_heads,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr):
        """The K and V tiles of keys [start, start + BLOCK_N) as `_kv_load` gives them (k,
        its scales, v, its scales)."""
        slots, in_range = _kv_slots(page_row, start + tl.arange(0, BLOCK_N), kv_hi, PAGE_SIZE)
        k, ks = _kv_load(k_cache, k_scale, slots, in_range, head, num_heads, BLOCK_N, HEAD_DIM,
                         GROUP, QUANT)
        v, vs = _kv_load(v_cache, v_scale, slots, in_range, head, num_heads, BLOCK_N, HEAD_DIM,
                         GROUP, QUANT)
        return k, ks, v, vs

    @triton.jit
    def _kv_values(x, s, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, ASM: tl.constexpr):
        """A tile of `_kv_load` as [BLOCK_N, HEAD_DIM] OUT_DTYPE, dequantized in registers
        when QUANT (ASM: in fp16, four codes per instruction, kv_quant.INT8_WORD_PTX)."""
        if QUANT:
            x = tl.reshape(dequantize_int8_words(x, s, ASM), (BLOCK_N, HEAD_DIM))
        return x.to(OUT_DTYPE)

    @triton.jit
    def _attend_tile(start, qt, m_i, l_i, acc, pos, kv_hi, window, page_row, k_cache, v_cache,
                     k_scale, v_scale, kv_head, num_kv_heads, qk_scale, k_next, ks_next,
                     v_next, vs_next, k_far, ks_far, v_far, vs_far, BLOCK_N: tl.constexpr,
                     HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     QUANT: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     MASKED: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr):
        """Keys [start, start + BLOCK_N) into the online softmax (m_i, l_i, acc) of the rows
        at positions `pos`. Without MASKED every row sees every key of the tile (the caller
        knows), so no score is masked. With PREFETCH the tile is k_next .. vs_next, and the
        one PREFETCH tiles ahead is loaded (into k_next .. at 1; at 2 into k_far .., whose
        tile moves to k_next)."""
        n = start + tl.arange(0, BLOCK_N)
        if PREFETCH:
            kx, ks, vx, vs = k_next, ks_next, v_next, vs_next
            in_range = n < kv_hi
            ahead = _kv_tiles(page_row, start + PREFETCH * BLOCK_N, kv_hi, k_cache, v_cache,
                              k_scale, v_scale, kv_head, num_kv_heads, BLOCK_N, HEAD_DIM,
                              GROUP, PAGE_SIZE, QUANT)
            if PREFETCH == 2:
                k_next, ks_next, v_next, vs_next = k_far, ks_far, v_far, vs_far
                k_far, ks_far, v_far, vs_far = ahead
            else:
                k_next, ks_next, v_next, vs_next = ahead
        else:
            slots, in_range = _kv_slots(page_row, n, kv_hi, PAGE_SIZE, MASKED)
            kx, ks = _kv_load(k_cache, k_scale, slots, in_range, kv_head, num_kv_heads,
                              BLOCK_N, HEAD_DIM, GROUP, QUANT)
        kt = _kv_values(kx, ks, qt.dtype, BLOCK_N, HEAD_DIM, QUANT, ASM)
        # scores unscaled: the row max scaled once (the same value: rounding is monotone),
        # each exponent one fma, in masked and whole tiles alike (so a row's bits do not
        # depend on which tiles its block masks)
        s = tl.dot(qt, tl.trans(kt), input_precision=DOT_PRECISION)
        if MASKED:
            seen = in_range[None, :]
            if CAUSAL:
                seen = seen & (n[None, :] <= pos[:, None])
            if HAS_WINDOW:
                seen = seen & (pos[:, None] - n[None, :] < window)
                if not CAUSAL:
                    seen = seen & (n[None, :] - pos[:, None] < window)
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = m_new  # finite where every key is seen
        if MASKED:  # a row with nothing visible yet keeps m = -inf; subtracting 0 keeps exp2 at 0
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(tl.fma(s, qk_scale, -m_safe[:, None]))
        alpha = tl.exp2(m_i - m_safe)
        if not PREFETCH:  # V's load after the softmax's math, as K's before it
            vx, vs = _kv_load(v_cache, v_scale, slots, in_range, kv_head, num_kv_heads,
                              BLOCK_N, HEAD_DIM, GROUP, QUANT)
        vt = _kv_values(vx, vs, qt.dtype, BLOCK_N, HEAD_DIM, QUANT, ASM)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
        return m_new, l_i, acc, k_next, ks_next, v_next, vs_next, k_far, ks_far, v_far, vs_far

    # the split floor is in the key: it sets the keys a program walks, and with them the
    # programs an SM should hold (which the configs' warps and registers decide)
    @triton.autotune(configs=_configs(),
                     key=["BLOCK_M", "GROUP_HEADS", "HEAD_DIM", "QUANT", "NUM_SPLITS", "CAUSAL",
                          "HAS_WINDOW", "ASM", "min_split_tokens"],
                     prune_configs_by={"early_config_prune": _prune_configs},
                     cache_results=True)
    # Triton compiles a variant per value class of an int argument (== 1, divisible by 16, other);
    # these vary from step to step (the page table's width is the longest sequence's page count),
    # so the start-up warm-up could not meet every class and a first request compiled one (the
    # H200 engine bench, docs/perf.md). Not specializing them costs nothing measurable: they only
    # address the page-table row and bound the splits.
    @triton.jit(do_not_specialize=["stride_pt", "num_seqs", "min_split_tokens", "window"])
    def _paged_attention_kernel(
        q, stride_qt, stride_qh, k_cache, v_cache, k_scale, v_scale,
        page_tables, stride_pt, cu_seqlens, context_lens, num_seqs, num_kv_heads, qk_scale,
        out, stride_ot, stride_oh, gate, stride_gt, stride_gh, part_out, part_lse,
        min_split_tokens, window,
        GROUP_HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, QUANT: tl.constexpr, HAS_GATE: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
        ASM: tl.constexpr, PREFETCH: tl.constexpr, GDC: tl.constexpr,
    ):
        """Program (block, kv head, split): rows r of the tile are query token r // GROUP_HEADS
        of the block and q head kv_head * GROUP_HEADS + r % GROUP_HEADS. Keys are walked over
        [kv_start, kv_end): what the block's rows can see at all (visible_keys).

        The step's segment bounds and context lengths (copied in before the step's first
        kernel, no kernel writes them) are read before `wait_for_inputs` (PDL): the block's
        place and its keys' range, a binary search over cu_seqlens, come while the
        predecessor still runs; q and the keys after the wait."""
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_HEADS
        # the GPU starts programs in launch order: the last query blocks, which see the most
        # keys of a causal prompt, go first, so that short ones, not long ones, end the grid
        block = tl.num_programs(0) - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq, first = block_of(cu_seqlens, block, num_seqs, BLOCK_Q)
        seq_end = tl.load(cu_seqlens + seq + 1)
        context = tl.load(context_lens + seq)
        # every program waits before it ends, a spare one too: that a grid has ended must mean
        # its predecessors have (ops.launch)
        wait_for_inputs(GDC)
        if first >= seq_end:
            return  # spare program: this sequence has fewer blocks than the grid leaves room for

        rows = tl.arange(0, BLOCK_M)
        tok = first + rows // GROUP_HEADS  # [BLOCK_M] query token (row of q)
        head = kv_head * GROUP_HEADS + rows % GROUP_HEADS
        valid = (rows < BLOCK_Q * GROUP_HEADS) & (tok < seq_end)
        pos = context - (seq_end - tok)  # each row's position (causal: it sees keys 0 .. pos)
        kv_end = context
        if CAUSAL:  # the block's last row sees the furthest
            kv_end = context - (seq_end - tl.minimum(first + BLOCK_Q, seq_end))
        kv_start = 0
        if HAS_WINDOW:  # the first row's window starts earliest
            kv_start = tl.maximum(context - (seq_end - first) - window + 1, 0)
        if NUM_SPLITS == 1:
            kv_lo = kv_start
            kv_hi = kv_end
        else:
            split_len = tl.maximum(tl.cdiv(kv_end - kv_start, NUM_SPLITS), min_split_tokens)
            split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
            kv_lo = kv_start + split * split_len
            kv_hi = tl.minimum(kv_lo + split_len, kv_end)

        d = tl.arange(0, HEAD_DIM)
        qt = tl.load(q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                     mask=valid[:, None], other=0.0)
        if QUANT and ASM:  # the INT8 tiles come out in fp16: the dots run in fp16
            qt = qt.to(tl.float16)
        page_row = page_tables + seq * stride_pt
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # PREFETCH: the next tile, and at 2 the one after it (else placeholders)
        k_next, ks_next, v_next, vs_next = 0.0, 0.0, 0.0, 0.0
        k_far, ks_far, v_far, vs_far = 0.0, 0.0, 0.0, 0.0
        if PREFETCH:  # the first tiles; each iteration then loads one more before computing
            k_next, ks_next, v_next, vs_next = _kv_tiles(
                page_row, kv_lo, kv_hi, k_cache, v_cache, k_scale, v_scale, kv_head,
                num_kv_heads, BLOCK_N, HEAD_DIM, GROUP, PAGE_SIZE, QUANT)
        if PREFETCH == 2:
            k_far, ks_far, v_far, vs_far = _kv_tiles(
                page_row, kv_lo + BLOCK_N, kv_hi, k_cache, v_cache, k_scale, v_scale, kv_head,
                num_kv_heads, BLOCK_N, HEAD_DIM, GROUP, PAGE_SIZE, QUANT)
        # Whole tiles every row sees (below the block's first position, before kv_hi) need no
        # mask: walked first, without one (sm_90 SASS, INT8 prompt tile: 931 instructions a
        # thread an iteration against 1,198 masked); the rest (the diagonal, a partial last
        # tile, any windowed tile) with it. The same sums in the same order either way.
        # Prefetching decode tiles keep one loop: carried from one loop into the next, their
        # tiles cost more registers and permutes than the mask saves.
        ONE_LOOP: tl.constexpr = HAS_WINDOW or PREFETCH > 0
        full_hi = kv_lo
        if not ONE_LOOP:
            seen_by_all = kv_hi
            if CAUSAL:
                seen_by_all = tl.minimum(kv_hi, context - (seq_end - first) + 1)
            full_hi = kv_lo + tl.maximum(seen_by_all - kv_lo, 0) // BLOCK_N * BLOCK_N
        for masked in tl.static_range(ONE_LOOP, 2):  # 0: the whole tiles, 1: the rest
            lo = full_hi if masked else kv_lo
            hi = kv_hi if masked else full_hi
            for start in range(lo, hi, BLOCK_N):
                (m_i, l_i, acc, k_next, ks_next, v_next, vs_next, k_far, ks_far, v_far,
                 vs_far) = _attend_tile(
                    start, qt, m_i, l_i, acc, pos, kv_hi, window, page_row, k_cache, v_cache,
                    k_scale, v_scale, kv_head, num_kv_heads, qk_scale, k_next, ks_next, v_next,
                    vs_next, k_far, ks_far, v_far, vs_far, BLOCK_N, HEAD_DIM, GROUP, PAGE_SIZE,
                    QUANT, CAUSAL, HAS_WINDOW, masked == 1, DOT_PRECISION, ASM, PREFETCH)

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows may see no key
            if HAS_GATE:
                g = tl.load(gate + tok[:, None] * stride_gt + head[:, None] * stride_gh
                            + d[None, :], mask=valid[:, None], other=0.0)
                o = o * tl.sigmoid(g.to(tl.float32))
            tl.store(out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     o.to(out.dtype.element_ty), mask=valid[:, None])
        else:
            # partials [N, nq, NUM_SPLITS, (HEAD_DIM)]: the split's normalized output (zero
            # for a row that saw no key here) and its log2-sum-exp2 (-inf for that row)
            part = (tok * (num_kv_heads * GROUP_HEADS) + head) * NUM_SPLITS + split
            seen_any = l_i > 0
            lse = tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
            o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
            tl.store(part_lse + part, lse, mask=valid)
            tl.store(part_out + part[:, None] * HEAD_DIM + d[None, :], o, mask=valid[:, None])

    @triton.jit
    def _merge_splits_kernel(part_out, part_lse, out, stride_ot, stride_oh, gate, stride_gt,
                             stride_gh, xo_ptr, inv_ptr, xsum_ptr, num_tokens, num_heads,
                             NUM_SPLITS: tl.constexpr, AT_ONCE: tl.constexpr,
                             HEAD_DIM: tl.constexpr, HEADS: tl.constexpr,
                             HAS_GATE: tl.constexpr,
                             OPERAND: tl.constexpr, GROUP: tl.constexpr, HAS_SUM: tl.constexpr,
                             GDC: tl.constexpr):
        """Program (token, HEADS heads): the splits' outputs weighted by their share of the
        softmax, AT_ONCE splits a round (the running max rescales the rounds before; with
        one round, the bits of a plain weighted sum). A split that saw no key of a row
        stored a zero output and lse -inf for it, so a round's outputs load with its lses,
        not after them (masked by the lse, the loads would wait a round trip for it). With
        OPERAND (HEADS 1), also the head's HEAD_DIM / GROUP
        groups of the decode operand of the output read as [tokens, heads * HEAD_DIM]
        (`store_operand`, of the rounded output as stored)."""
        tl.static_assert(HEADS == 1 or not OPERAND, "the operand is written a head at a time")
        wait_for_inputs(GDC)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        h_ok = h < num_heads
        d = tl.arange(0, HEAD_DIM)
        m = tl.full([HEADS], float("-inf"), tl.float32)
        total = tl.zeros([HEADS], tl.float32)
        o = tl.zeros([HEADS, HEAD_DIM], tl.float32)
        # a row's first visible key is at most a block's tokens past split 0's first key, so
        # in the first round's splits: the running max is finite from that round on (missing
        # heads read lse 0)
        for first in tl.static_range(0, NUM_SPLITS, AT_ONCE):
            part = ((t * num_heads + h)[:, None] * NUM_SPLITS + first
                    + tl.arange(0, AT_ONCE)[None, :])
            lse = tl.load(part_lse + part, mask=h_ok[:, None], other=0.0)
            parts = tl.load(part_out + part[:, :, None] * HEAD_DIM + d[None, None, :],
                            mask=h_ok[:, None, None], other=0.0)
            m_new = tl.maximum(m, tl.max(lse, 1))
            w = tl.exp2(lse - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            total = total * alpha + tl.sum(w, 1)
            o = o * alpha[:, None] + tl.sum(parts * w[:, :, None], 1)
            m = m_new
        o = o / total[:, None]
        if HAS_GATE:
            g = tl.load(gate + t * stride_gt + h[:, None] * stride_gh + d[None, :],
                        mask=h_ok[:, None], other=0.0)
            o = o * tl.sigmoid(g.to(tl.float32))
        o = o.to(out.dtype.element_ty)
        tl.store(out + t * stride_ot + h[:, None] * stride_oh + d[None, :], o,
                 mask=h_ok[:, None])
        if OPERAND:
            rows = t + tl.arange(0, 1)
            store_operand(o.to(tl.float32), rows, rows < num_tokens,
                          tl.program_id(1) * HEAD_DIM, num_tokens, num_heads * HEAD_DIM,
                          xo_ptr, inv_ptr, xsum_ptr, GROUP, HAS_SUM)

    @triton.jit
    def _gather_kv_kernel(cache_, scales, pages, out, stride_oh, stride_ot, length, num_heads,
                          PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_T: tl.constexpr, QUANT: tl.constexpr):
        """Program (BLOCK_T tokens, kv head): the head's rows of those tokens out of their
        pages into out (strides per head and token; rows contiguous), dequantized with QUANT
        as dequantize_int8 does (fp32 products rounded once to out's dtype), else
        converted."""
        head = tl.program_id(1)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        valid = t < length
        page = tl.load(pages + t // PAGE_SIZE, mask=valid, other=0)
        row = (page * PAGE_SIZE + t % PAGE_SIZE) * num_heads + head
        d = tl.arange(0, HEAD_DIM)
        x = tl.load(cache_ + row[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0)
        if QUANT:
            s = tl.load(scales + row[:, None] * (HEAD_DIM // GROUP) + d[None, :] // GROUP,
                        mask=valid[:, None], other=0.0)
            x = x.to(tl.float32) * s.to(tl.float32)
        tl.store(out + head * stride_oh + t[:, None] * stride_ot + d[None, :],
                 x.to(out.dtype.element_ty), mask=valid[:, None])

    @triton.jit
    def _gated_output_kernel(o, stride_oh, stride_ot, gate, stride_gt, stride_gh, out, length,
                             num_heads, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                             HAS_GATE: tl.constexpr):
        """Program (BLOCK_T tokens, q head): the head's output rows o [heads, T, HEAD_DIM]
        into out [T, heads, HEAD_DIM], times sigmoid(gate) with HAS_GATE (in fp32, as the
        split merge applies it)."""
        head = tl.program_id(1)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        valid = t < length
        d = tl.arange(0, HEAD_DIM)
        x = tl.load(o + head * stride_oh + t[:, None] * stride_ot + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(gate + t[:, None] * stride_gt + head * stride_gh + d[None, :],
                        mask=valid[:, None], other=0.0)
            x = x * tl.sigmoid(g.to(tl.float32))
        tl.store(out + (t * num_heads + head)[:, None] * HEAD_DIM + d[None, :],
                 x.to(out.dtype.element_ty), mask=valid[:, None])


def _gather_kv_triton(cache_: torch.Tensor, scales: torch.Tensor | None, pages: torch.Tensor,
                      length: int, dtype: torch.dtype, *, head_major: bool) -> torch.Tensor:
    """The first `length` tokens stored in `pages` in `dtype`, in one pass
    (`_gather_kv_kernel`): [nkv, length, d] head-major, else [length, nkv, d]."""
    _check_cache(cache_, scales)
    _, page_size, nkv, d = cache_.shape
    assert pages.dtype == torch.int64 and pages.stride(-1) == 1 and d == _pow2(d)
    assert length <= pages.shape[0] * page_size
    shape = (nkv, length, d) if head_major else (length, nkv, d)
    out = torch.empty(shape, dtype=dtype, device=cache_.device)
    stride_head, stride_token = (out.stride(0), out.stride(1)) if head_major else \
        (out.stride(1), out.stride(0))
    quant = scales is not None
    _gather_kv_kernel[(triton.cdiv(length, FRESH_BLOCK_T), nkv)](
        cache_, scales if quant else cache_, pages, out, stride_head, stride_token, length, nkv,
        PAGE_SIZE=page_size, HEAD_DIM=d, GROUP=d // scales.shape[-1] if quant else d,
        BLOCK_T=FRESH_BLOCK_T, QUANT=quant)
    return out


def _gated_output_triton(o: torch.Tensor, gate: torch.Tensor | None,
                         dtype: torch.dtype) -> torch.Tensor:
    """o [nq, T, d] (attention's output, any strides but d's) as [T, nq, d] in `dtype`, times
    sigmoid(gate) [T, nq, d] when given, in one pass (`_gated_output_kernel`)."""
    nq, t, d = o.shape
    assert o.stride(-1) == 1 and d == _pow2(d)
    assert gate is None or (gate.shape == (t, nq, d) and gate.stride(-1) == 1)
    out = torch.empty((t, nq, d), dtype=dtype, device=o.device)
    g = o if gate is None else gate
    _gated_output_kernel[(triton.cdiv(t, FRESH_BLOCK_T), nq)](
        o, o.stride(0), o.stride(1), g, g.stride(0), g.stride(1), out, t, nq, HEAD_DIM=d,
        BLOCK_T=FRESH_BLOCK_T, HAS_GATE=gate is not None)
    return out


def _merge_heads(num_splits: int, num_heads: int) -> int:
    """Heads a merge program takes: up to MERGE_PARTIALS partial outputs of a token (a prompt
    chunk's few splits: 8 heads a program, 16x fewer programs than one a head, which took
    ~100 us to merge a 35B chunk of 1,024 tokens; decode's 64 splits: one head)."""
    return max(1, min(_pow2(num_heads), MERGE_PARTIALS // num_splits))


def _merge_warps(partial_values: int) -> int:
    """Warps of a merge program that loads `partial_values` fp32 values at once: ~64 a thread
    (4 warps held a decode head's 64 splits in 186 registers, 128 splits spilled; 8 and 16
    warps hold them in 99 and 105: sm_90 SASS, Triton 3.6)."""
    return min(16, max(4, partial_values // (32 * 64)))


def _check_cache(cache_: torch.Tensor, scales: torch.Tensor | None) -> None:
    assert cache_.is_contiguous(), "KV cache pages must be contiguous"
    if scales is not None:
        assert cache_.dtype == torch.int8 and scales.dtype == torch.float16
        assert scales.is_contiguous() and scales.shape[:3] == cache_.shape[:3]


def _store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    """Launches the fused quantize + scatter kernel (one program per token)."""
    store = KVStore(k_cache, v_cache, k_scale, v_scale, slot_mapping)
    _store_kv_kernel[(k.shape[0],)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), *store_args(k, v, store),
        k.shape[1], **store_constexprs(k, store), **options(k.device),
    )


def store_args(k: torch.Tensor, v: torch.Tensor, store: KVStore) -> tuple:
    """The caches, scales (the caches again for bf16: unused) and slots `store_token` takes,
    after checking them against k, v [N, nkv, d]."""
    n, nkv, d = k.shape
    assert v.shape == k.shape and store.k_cache.shape[2:] == (nkv, d) \
        and store.v_cache.shape == store.k_cache.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "K/V rows must be contiguous along d"
    assert store.slot_mapping.shape == (n,) and store.slot_mapping.dtype == torch.int64
    assert (store.k_scale is None) == (store.v_scale is None)
    _check_cache(store.k_cache, store.k_scale)
    _check_cache(store.v_cache, store.v_scale)
    quant = store.k_scale is not None
    return (store.k_cache, store.v_cache, store.k_scale if quant else store.k_cache,
            store.v_scale if quant else store.v_cache, store.slot_mapping)


def store_constexprs(k: torch.Tensor, store: KVStore) -> dict:
    """`store_token`'s constexprs for k [N, nkv, d]: a token's heads padded to a power of two,
    d as GROUPS groups of GROUP (one group per int8 scale; d itself for bf16 caches)."""
    nkv, d = k.shape[1:]
    quant = store.k_scale is not None
    group = d // store.k_scale.shape[-1] if quant else d
    assert d == _pow2(d) and group == _pow2(group)
    return {"HEADS": _pow2(nkv), "GROUPS": d // group, "GROUP": group, "QUANT": quant}


def _paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                            page_tables: torch.Tensor, cu_seqlens: torch.Tensor,
                            context_lens: torch.Tensor, scale: float,
                            gate: torch.Tensor | None = None, *, causal: bool = True,
                            window: int | None = None, num_splits: int | None = None,
                            min_split_tokens: int = MIN_SPLIT_TOKENS,
                            operand_spec: tuple[int, bool] | None = None,
                            out_dtype: torch.dtype | None = None
                            ) -> tuple[torch.Tensor, DecodeOperand | None]:
    """Launches the attention kernel (and the split merge when the context is split): the
    output (in out_dtype, by default q's) and, with `operand_spec` (group, sums) and a split
    context, its decode operand that the merge writes (`paged_attention_with_operand`), else
    None. num_splits / min_split_tokens override the plan (tests reach the split path with
    them)."""
    n, nq, d = q.shape
    _, page_size, nkv, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    assert _kernel_fits(q, k_cache) and v_cache.shape == k_cache.shape
    assert q.stride(-1) == 1 and (gate is None or (gate.shape == q.shape and gate.stride(-1) == 1))
    assert (k_scale is None) == (v_scale is None)
    _check_cache(k_cache, k_scale)
    _check_cache(v_cache, v_scale)
    if k_scale is None:
        assert k_cache.dtype == v_cache.dtype
    assert cu_seqlens.shape == (num_seqs + 1,) and page_tables.shape[0] == num_seqs
    for meta in (page_tables, cu_seqlens, context_lens):
        assert meta.dtype == torch.int64 and meta.stride(-1) == 1
    quant = k_scale is not None
    group = d // k_scale.shape[-1] if quant else d
    plan = launch_plan(n, num_seqs, nq // nkv, nkv, _num_sms(q.device), num_splits)
    assert plan.num_splits == _pow2(plan.num_splits)
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    split = plan.num_splits > 1
    part_out = torch.empty((n, nq, plan.num_splits, d) if split else (1,), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((n, nq, plan.num_splits) if split else (1,), dtype=torch.float32,
                           device=q.device)
    g = q if gate is None else gate
    launch(
        _paged_attention_kernel, (plan.num_blocks, nkv, plan.num_splits),
        q, q.stride(0), q.stride(1), k_cache, v_cache,
        k_scale if quant else k_cache, v_scale if quant else v_cache,
        page_tables, page_tables.stride(0), cu_seqlens, context_lens, num_seqs, nkv,
        scale * LOG2E, out, out.stride(0), out.stride(1), g, g.stride(0), g.stride(1),
        part_out, part_lse, min_split_tokens, 0 if window is None else window,
        GROUP_HEADS=nq // nkv, BLOCK_M=plan.block_m, HEAD_DIM=d, GROUP=group,
        PAGE_SIZE=page_size, NUM_SPLITS=plan.num_splits, QUANT=quant, HAS_GATE=gate is not None,
        CAUSAL=causal, HAS_WINDOW=window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        ASM=KV_DEQUANT_ASM and q.dtype != torch.float32,
        **options(q.device),
    )
    if not split:
        return out, None
    assert operand_spec is None or d % operand_spec[0] == 0, "a head must hold whole groups"
    operand = None if operand_spec is None else DecodeOperand.empty(n, nq * d, *operand_spec,
                                                                    q.device)
    heads = 1 if operand is not None else _merge_heads(plan.num_splits, nq)
    at_once = min(plan.num_splits, MERGE_SPLITS_AT_ONCE)
    _merge_splits_kernel[(n, triton.cdiv(nq, heads))](
        part_out, part_lse, out, out.stride(0), out.stride(1), g, g.stride(0), g.stride(1),
        *operand_buffers(operand, out), n, nq, NUM_SPLITS=plan.num_splits, AT_ONCE=at_once,
        HEAD_DIM=d, HEADS=heads, HAS_GATE=gate is not None,
        OPERAND=operand is not None, GROUP=operand.group if operand else d,
        HAS_SUM=operand is not None and operand.sums,
        num_warps=_merge_warps(heads * at_once * d), **options(q.device),
    )
    return out, operand
