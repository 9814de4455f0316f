"""The Qwen3.5 decoder layer over ops: gated attention or Gated DeltaNet, then MLP or MoE.

Each block reads its weights from a `models.weights` record and its per-sequence state from a
`models.cache` record, which it updates (K/V appended, conv and recurrent state replaced).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_runtime.config import ModelConfig
from ninfer_runtime.models.cache import GDNState, KVState, SequenceCache
from ninfer_runtime.models.weights import (
    AttentionWeights,
    DecoderLayerWeights,
    GDNWeights,
    MLPWeights,
    MoEWeights,
)
from ninfer_runtime.ops.activation import silu_and_mul
from ninfer_runtime.ops.attention import causal_attention
from ninfer_runtime.ops.conv import causal_conv1d, causal_conv1d_update
from ninfer_runtime.ops.gdn import chunk_gated_delta_rule, gdn_gating, recurrent_gated_delta_rule
from ninfer_runtime.ops.linear import linear
from ninfer_runtime.ops.moe import moe_experts, route
from ninfer_runtime.ops.norm import gated_rms_norm, rms_norm
from ninfer_runtime.ops.rope import apply_rope, rope_cos_sin

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, rotary_dim]


def gated_attention(x: torch.Tensor, w: AttentionWeights, kv: KVState, rope: Rope,
                    cfg: ModelConfig) -> torch.Tensor:
    """Full attention with q/k RMSNorm, partial RoPE and a sigmoid output gate: [T, H]."""
    t, nq, nkv, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_gate, k, v = linear(x, w.qkv_proj).split([2 * nq * hd, nkv * hd, nkv * hd], dim=-1)
    q, gate = q_gate.reshape(t, nq, 2 * hd).chunk(2, dim=-1)  # per head: [q | gate]
    q = apply_rope(rms_norm(q, w.q_norm, cfg.rms_norm_eps), *rope)
    k = apply_rope(rms_norm(k.reshape(t, nkv, hd), w.k_norm, cfg.rms_norm_eps), *rope)
    kv.append(k, v.reshape(t, nkv, hd))
    out = causal_attention(q, kv.k, kv.v, hd**-0.5).reshape(t, nq * hd)
    return linear(out * torch.sigmoid(gate.reshape(t, nq * hd)), w.o_proj)


def gated_delta_net(x: torch.Tensor, w: GDNWeights, state: GDNState,
                    cfg: ModelConfig) -> torch.Tensor:
    """The GDN token mixer: [T, H]. One token takes the recurrent (decode) path, several the
    chunked (prompt) path; both continue from and replace the sequence's state."""
    t, nv, dv = x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim
    key_dim = cfg.linear_key_dim
    mixed, z = linear(x, w.in_proj_qkvz).split([cfg.conv_dim, cfg.linear_value_dim], dim=-1)
    b, a = linear(x, w.in_proj_ba).chunk(2, dim=-1)
    if t == 1:
        mixed, state.conv = causal_conv1d_update(mixed[0], w.conv1d, state.conv)
        mixed = mixed[None]
    else:
        mixed, state.conv = causal_conv1d(mixed, w.conv1d, state.conv)
    q, k, v = mixed.split([key_dim, key_dim, cfg.linear_value_dim], dim=-1)
    q = q.reshape(t, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    k = k.reshape(t, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    g, beta = gdn_gating(a, b, w.A_log, w.dt_bias)
    rule = recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule
    out, state.recurrent = rule(q, k, v.reshape(t, nv, dv), g, beta, state.recurrent)
    out = gated_rms_norm(out, z.reshape(t, nv, dv), w.norm, cfg.rms_norm_eps)
    return linear(out.reshape(t, nv * dv), w.out_proj)


def mlp(x: torch.Tensor, w: MLPWeights) -> torch.Tensor:
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""
    return linear(silu_and_mul(linear(x, w.gate_up_proj)), w.down_proj)


def sparse_moe(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig) -> torch.Tensor:
    """Routed experts (top-k, renormalised) plus the sigmoid-gated shared expert."""
    weights, ids = route(linear(x, w.router), cfg.num_experts_per_tok)
    routed = moe_experts(x, w.experts_gate_up, w.experts_down, weights, ids)
    return routed + torch.sigmoid(linear(x, w.shared_expert_gate)) * mlp(x, w.shared_expert)


def decoder_layer(x: torch.Tensor, w: DecoderLayerWeights, state: KVState | GDNState,
                  rope: Rope, cfg: ModelConfig) -> torch.Tensor:
    h = rms_norm(x, w.input_layernorm, cfg.rms_norm_eps)
    if isinstance(w.mixer, AttentionWeights):
        assert isinstance(state, KVState), "a full-attention layer needs a KVState"
        h = gated_attention(h, w.mixer, state, rope, cfg)
    else:
        assert isinstance(state, GDNState), "a GDN layer needs a GDNState"
        h = gated_delta_net(h, w.mixer, state, cfg)
    x = x + h
    h = rms_norm(x, w.post_attention_layernorm, cfg.rms_norm_eps)
    h = sparse_moe(h, w.mlp, cfg) if isinstance(w.mlp, MoEWeights) else mlp(h, w.mlp)
    return x + h


def run_layers(x: torch.Tensor, layers: Sequence[DecoderLayerWeights], cache: SequenceCache,
               start_pos: int, cfg: ModelConfig) -> torch.Tensor:
    """Push x [T, H] at positions start_pos .. start_pos+T-1 through `layers`, advancing
    `cache`. The cache must hold exactly the start_pos tokens before them."""
    if start_pos != cache.num_tokens:
        raise ValueError(f"start_pos {start_pos} does not continue the cache, which holds "
                         f"{cache.num_tokens} tokens (GDN state cannot be rewound)")
    if len(layers) != len(cache.layers):
        raise ValueError(f"cache has {len(cache.layers)} layers, the model {len(layers)}")
    positions = torch.arange(start_pos, start_pos + x.shape[0], device=x.device)
    rope = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    for w, state in zip(layers, cache.layers, strict=True):
        x = decoder_layer(x, w, state, rope, cfg)
    cache.num_tokens += x.shape[0]
    return x
