"""Mixture-of-experts routing and the routed SwiGLU experts.

The shared expert is an ordinary MLP gated by sigmoid(x . shared_expert_gate); the model
composes it from `linear` and `silu_and_mul`.
"""

from __future__ import annotations

import torch

from ninfer_runtime.ops.activation import silu_and_mul
from ninfer_runtime.ops.linear import Weight, linear, select


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax (fp32) -> top-k -> renormalise: (weights fp32 [T, k], expert ids [T, k]).

    Qwen3.5 always renormalises the top-k probabilities (no norm_topk_prob switch).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def moe_experts(x: torch.Tensor, gate_up: Weight, down: Weight, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H].

    gate_up [E, 2I, H] holds each expert's gate rows then up rows; down [E, H, I].
    """
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():  # reference: one dense matmul per used expert
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = silu_and_mul(linear(x[tokens], select(gate_up, e)))
        y = linear(h, select(down, e)) * weights[tokens, slots, None].to(x.dtype)
        out.index_add_(0, tokens, y)
    return out
