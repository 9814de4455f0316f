"""The Qwen3.5 decoder layer over ops: gated attention or Gated DeltaNet, then MLP or MoE.

This is the only layer implementation: the engine's batched steps and the single-sequence
path (offline API, MTP head, tests) both run it. Every block takes the step's tokens x [N, H]
and the `StepBatch` describing them; projections, norms, MLP and MoE run over all N tokens at
once, attention and the GDN mixer per sequence segment over that layer's cache (K/V stored into
the sequence's pages, conv and recurrent state continued in and written back to its slot).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_runtime.config import ModelConfig
from ninfer_runtime.engine.batch import StepBatch
from ninfer_runtime.models.cache import GDNSlots, LayerCache, PagedKV
from ninfer_runtime.models.weights import (
    AttentionWeights,
    DecoderLayerWeights,
    GDNWeights,
    MLPWeights,
    MoEWeights,
)
from ninfer_runtime.ops.activation import silu_and_mul
from ninfer_runtime.ops.attention import paged_attention, store_kv
from ninfer_runtime.ops.conv import causal_conv1d_varlen
from ninfer_runtime.ops.gdn import gated_delta_rule_varlen, gdn_decode, gdn_gating
from ninfer_runtime.ops.linear import linear
from ninfer_runtime.ops.moe import moe_experts, route
from ninfer_runtime.ops.norm import add_rms_norm, gated_rms_norm, rms_norm
from ninfer_runtime.ops.rope import qk_norm_rope, rope_cos_sin

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [N, rotary_dim]


def gated_attention(x: torch.Tensor, w: AttentionWeights, kv: PagedKV, batch: StepBatch,
                    rope: Rope, cfg: ModelConfig) -> torch.Tensor:
    """Full attention with q/k RMSNorm, partial RoPE and a sigmoid output gate: [N, H]."""
    n, nq, nkv, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_gate, k, v = linear(x, w.qkv_proj).split([2 * nq * hd, nkv * hd, nkv * hd], dim=-1)
    q, gate = q_gate.reshape(n, nq, 2 * hd).chunk(2, dim=-1)  # per head: [q | gate]
    q, k = qk_norm_rope(q, k.reshape(n, nkv, hd), w.q_norm, w.k_norm, *rope, cfg.rms_norm_eps)
    store_kv(k, v.reshape(n, nkv, hd), kv.k, kv.v, kv.k_scale, kv.v_scale, batch.slot_mapping)
    out = paged_attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, batch.page_tables,
                          batch.cu_seqlens, batch.context_lens, hd**-0.5, gate=gate)
    return linear(out.reshape(n, nq * hd), w.o_proj)


def gated_delta_net(x: torch.Tensor, w: GDNWeights, state: GDNSlots, batch: StepBatch,
                    cfg: ModelConfig) -> torch.Tensor:
    """The GDN token mixer: [N, H]. Per segment, one token takes the recurrent (decode) path,
    several the chunked (prompt) path; both continue from and replace the slot's state."""
    n, nv, dv = x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim
    key_dim = cfg.linear_key_dim
    mixed, z = linear(x, w.in_proj_qkvz).split([cfg.conv_dim, cfg.linear_value_dim], dim=-1)
    b, a = linear(x, w.in_proj_ba).chunk(2, dim=-1)
    if batch.decode_only:  # conv, gating and the recurrent update fused in one pass
        out = gdn_decode(mixed, a, b, w.conv1d, w.A_log, w.dt_bias, state.conv,
                         state.recurrent, batch.cu_seqlens, batch.state_slots)
    else:
        mixed = causal_conv1d_varlen(mixed, w.conv1d, state.conv, batch.cu_seqlens,
                                     batch.state_slots)
        q, k, v = mixed.split([key_dim, key_dim, cfg.linear_value_dim], dim=-1)
        q = q.reshape(n, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        k = k.reshape(n, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        g, beta = gdn_gating(a, b, w.A_log, w.dt_bias)
        out = gated_delta_rule_varlen(q, k, v.reshape(n, nv, dv), g, beta, state.recurrent,
                                      batch.cu_seqlens, batch.state_slots)
    out = gated_rms_norm(out, z.reshape(n, nv, dv), w.norm, cfg.rms_norm_eps)
    return linear(out.reshape(n, nv * dv), w.out_proj)


def mlp(x: torch.Tensor, w: MLPWeights) -> torch.Tensor:
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""
    return linear(silu_and_mul(linear(x, w.gate_up_proj)), w.down_proj)


def sparse_moe(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig) -> torch.Tensor:
    """Routed experts (top-k, renormalised) plus the sigmoid-gated shared expert."""
    weights, ids = route(linear(x, w.router), cfg.num_experts_per_tok)
    routed = moe_experts(x, w.experts_gate_up, w.experts_down, weights, ids)
    return routed + torch.sigmoid(linear(x, w.shared_expert_gate)) * mlp(x, w.shared_expert)


def decoder_layer(x: torch.Tensor, h: torch.Tensor | None, w: DecoderLayerWeights,
                  cache: LayerCache, batch: StepBatch, rope: Rope,
                  cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer on the residual stream x + h (h None: the stream is x alone).

    Returns the stream as (x, h), the MLP output h not yet added, so that the next layer's
    input norm adds it in the same pass (add_rms_norm); the sum is the one `x = x + h` makes.
    """
    eps = cfg.rms_norm_eps
    if h is None:
        h = rms_norm(x, w.input_layernorm, eps)
    else:
        x, h = add_rms_norm(x, h, w.input_layernorm, eps)
    if isinstance(w.mixer, AttentionWeights):
        assert isinstance(cache, PagedKV), "a full-attention layer needs a PagedKV cache"
        h = gated_attention(h, w.mixer, cache, batch, rope, cfg)
    else:
        assert isinstance(cache, GDNSlots), "a GDN layer needs a GDNSlots cache"
        h = gated_delta_net(h, w.mixer, cache, batch, cfg)
    x, h = add_rms_norm(x, h, w.post_attention_layernorm, eps)
    h = sparse_moe(h, w.mlp, cfg) if isinstance(w.mlp, MoEWeights) else mlp(h, w.mlp)
    return x, h


def run_layers(x: torch.Tensor, layers: Sequence[DecoderLayerWeights],
               caches: Sequence[LayerCache], batch: StepBatch,
               cfg: ModelConfig) -> torch.Tensor:
    """Push the step's tokens x [N, H] through `layers`, each over its cache."""
    if len(layers) != len(caches):
        raise ValueError(f"{len(caches)} layer caches for {len(layers)} layers")
    rope = rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta)
    h = None
    for w, cache in zip(layers, caches, strict=True):
        x, h = decoder_layer(x, h, w, cache, batch, rope, cfg)
    return x if h is None else x + h
