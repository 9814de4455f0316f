"""Causal grouped-query attention of new queries over a sequence's cached keys and values.

The sigmoid output gate of Qwen3.5's gated attention is applied by the caller (it is an
elementwise multiply on the output), so this op is plain softmax attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v with GQA.

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
