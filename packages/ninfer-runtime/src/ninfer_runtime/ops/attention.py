"""Attention over a paged KV cache: storing new keys/values, and causal GQA attention.

The cache of one full-attention layer is two tensors [num_pages, page_size, nkv, head_dim]
(K and V), either unquantized (the compute dtype) or int8 with fp16 scales
[num_pages, page_size, nkv, head_dim // group] (ops.kv_quant). A sequence owns a list of pages
(its page table row); its token at position p lives in page page_table[p // page_size] at
offset p % page_size. The flat slot of a token is page * page_size + offset.

The sigmoid output gate of Qwen3.5's gated attention is applied by the caller (it is an
elementwise multiply on the output), so these ops are plain softmax attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_runtime.ops.kv_quant import dequantize_int8, quantize_int8


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v with GQA, for one sequence.

    q [T, nq, d] are the queries of the last T positions of a sequence whose keys and values
    (including those T positions) are k, v [S, nkv, d], S >= T: query i sits at position
    S - T + i and sees keys 0 .. S - T + i. Query head h reads kv head h // (nq // nkv).
    Returns [T, nq, d] in q.dtype.
    """
    t, s = q.shape[0], k.shape[0]
    if s < t:
        raise ValueError(f"{t} queries need at least as many cached keys, got {s}")
    # [heads, len, d] for SDPA; the mask is True where attention is allowed.
    mask = None
    if t > 1:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
             slot_mapping: torch.Tensor) -> None:
    """Writes k, v [N, nkv, d] into the caches at the flat slots slot_mapping [N] (int64).

    With scales (int8 caches) the values are quantized per group on the way in.
    """
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])  # [num_pages * page_size, nkv, d]
        if scales is None:
            flat.index_copy_(0, slot_mapping, x.to(cache.dtype))
            continue
        q, s = quantize_int8(x, cache.shape[-1] // scales.shape[-1])
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
                    context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of B sequences' new queries over their paged keys and values.

    q [N, nq, d] holds the sequences' queries back to back: sequence b owns rows
    cu_seqlens[b] .. cu_seqlens[b+1] ([B+1]), the last positions of its context_lens[b] ([B])
    tokens, whose K/V (these positions included) are already stored in the pages of
    page_tables[b] ([B, max_pages], unused entries arbitrary). Returns [N, nq, d] in q.dtype.
    """
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    # NOTE: the reference reads the segment bounds on the host (a sync on a GPU); a kernel
    # takes the tensors as they are.
    bounds, lengths = cu_seqlens.tolist(), context_lens.tolist()
    for b, length in enumerate(lengths):
        lo, hi = bounds[b], bounds[b + 1]
        pages = page_tables[b, :-(-length // page_size)]
        k = gather_kv(k_cache, k_scale, pages, length, q.dtype)
        v = gather_kv(v_cache, v_scale, pages, length, q.dtype)
        out[lo:hi] = causal_attention(q[lo:hi], k, v, scale)
    return out
