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
from ninfer_runtime.ops.ablation import ablated, zeros
from ninfer_runtime.ops.attention import paged_attention_with_operand
from ninfer_runtime.ops.conv import causal_conv1d_varlen
from ninfer_runtime.ops.gdn import (
    OutputNorm,
    gated_delta_rule_varlen,
    gdn_decode,
    gdn_decode_norm,
    gdn_gating,
)
from ninfer_runtime.ops.linear import (
    Weight,
    decode_operand_spec,
    linear,
    linear_with_operand,
    mlp_decode,
    silu_mul_linear,
    swiglu_with_operand,
)
from ninfer_runtime.ops.moe import gate_up_operand_spec, moe_experts, router
from ninfer_runtime.ops.norm import (
    DeferredNorm,
    add_rms_norm,
    defer_add_rms_norm,
    gated_rms_norm,
    gated_rms_norm_with_operand,
    rms_norm,
    run_deferred,
)
from ninfer_runtime.ops.quant_linear import DecodeOperand
from ninfer_runtime.ops.rope import qk_norm_rope_store, rope_cos_sin

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [N, rotary_dim]


def gated_attention(x: torch.Tensor, w: AttentionWeights, kv: PagedKV, batch: StepBatch,
                    rope: Rope, cfg: ModelConfig, norm: DeferredNorm | None = None
                    ) -> torch.Tensor:
    """Full attention with q/k RMSNorm, partial RoPE and a sigmoid output gate: [N, H].
    `norm`: the input norm whose output x is, not yet run (the q|k|v product runs it)."""
    n, nq, nkv, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_gate, k, v = linear(x, w.qkv_proj, norm=norm).split([2 * nq * hd, nkv * hd, nkv * hd],
                                                          dim=-1)
    q, gate = q_gate.reshape(n, nq, 2 * hd).chunk(2, dim=-1)  # per head: [q | gate]
    if ablated("rope", x):
        q = zeros("q", (n, nq, hd), x.dtype, x.device)
    else:
        q = qk_norm_rope_store(q, k.reshape(n, nkv, hd), v.reshape(n, nkv, hd), w.q_norm,
                               w.k_norm, *rope, cfg.rms_norm_eps, kv.store(batch.slot_mapping))
    # the split merge can write o_proj's decode operand
    spec = decode_operand_spec(q.flatten(1), w.o_proj)
    if ablated("attn", x):
        out = zeros("attention", q.shape, q.dtype, q.device)
        operand = _ablated_operand(q.flatten(1), spec)
    else:
        out, operand = paged_attention_with_operand(
            q, kv.k, kv.v, kv.k_scale, kv.v_scale, batch.page_tables, batch.cu_seqlens,
            batch.context_lens, hd**-0.5, gate, spec, batch.lone_prompt_context)
    return linear(out.reshape(n, nq * hd), w.o_proj, operand)


def gated_delta_net(x: torch.Tensor, w: GDNWeights, state: GDNSlots, batch: StepBatch,
                    cfg: ModelConfig, norm: DeferredNorm | None = None) -> torch.Tensor:
    """The GDN token mixer: [N, H]. The step's leading `recurrent_tokens` rows (decode tokens,
    speculative verify segments) take the fused recurrent path, the rest (prompt chunks) the
    chunked path; both continue from and replace the slots' state (or, for verify segments,
    leave the state after each token in its snapshot slot). `norm`: the input norm whose
    output x is, not yet run (in_proj_ba's launch runs it where it can)."""
    n, nv, dv = x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim
    # in_proj_ba first: its kernel can write x's operand for in_proj_qkvz's decode GEMV
    spec = decode_operand_spec(x, w.in_proj_qkvz)
    if ablated("skinny", x):
        run_deferred(norm)
        ba, operand = zeros("ba", (n, 2 * nv), x.dtype, x.device), _ablated_operand(x, spec)
    else:
        ba, operand = linear_with_operand(x, w.in_proj_ba, spec, norm)
    b, a = ba.chunk(2, dim=-1)
    mixed, z = linear(x, w.in_proj_qkvz, operand).split([cfg.conv_dim, cfg.linear_value_dim],
                                                        dim=-1)
    r, seqs = batch.recurrent_tokens, batch.recurrent_seqs
    # conv, gating and the recurrent update fused in one pass
    recurrent = (mixed[:r], a[:r], b[:r], w.conv1d, w.A_log, w.dt_bias, state.conv,
                 state.recurrent, batch.cu_seqlens[:seqs + 1], batch.state_slots[:seqs],
                 batch.snapshot_slots)
    heads_z = z.reshape(n, nv, dv)
    if r and r == n:  # decode and verify rows only: the output norm runs in that pass too
        spec = decode_operand_spec(z, w.out_proj)
        if ablated("gdn", x):
            out = zeros("gdn", heads_z.shape, z.dtype, z.device)
            operand = _ablated_operand(z, spec)
        else:
            out, operand = gdn_decode_norm(*recurrent, OutputNorm(heads_z, w.norm,
                                                                  cfg.rms_norm_eps, spec))
    else:
        parts = [gdn_decode(*recurrent)] if r else []
        parts.append(_chunked_gdn(mixed[r:], a[r:], b[r:], w, state, batch.chunked_cu_seqlens,
                                  batch.state_slots[seqs:], cfg))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        out, operand = gated_norm(out, heads_z, w.norm, cfg.rms_norm_eps, w.out_proj)
    return linear(out.reshape(n, nv * dv), w.out_proj, operand)


def _chunked_gdn(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: GDNWeights,
                 state: GDNSlots, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                 cfg: ModelConfig) -> torch.Tensor:
    """The prompt path of the mixer core: varlen conv, gating, chunked delta rule."""
    n, key_dim = mixed.shape[0], cfg.linear_key_dim
    # q, k and v each contiguous (fla-core's kernels would copy strided views)
    q, k, v = causal_conv1d_varlen(mixed, w.conv1d, state.conv, cu_seqlens, slots,
                                   split=(key_dim, key_dim, cfg.linear_value_dim))
    q = q.reshape(n, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    k = k.reshape(n, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    g, beta = gdn_gating(a, b, w.A_log, w.dt_bias)
    return gated_delta_rule_varlen(q, k, v.reshape(n, cfg.linear_num_value_heads,
                                                   cfg.linear_value_head_dim),
                                   g, beta, state.recurrent, cu_seqlens, slots)


def mlp(x: torch.Tensor, w: MLPWeights, norm: DeferredNorm | None = None) -> torch.Tensor:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). At decode the gate|up GEMV can hand the SiLU
    product on as the down GEMV's operand (x stands in for that product's rows in the spec:
    the same rows, dtype and device); the two GEMVs run as one launch where they can
    (`mlp_decode`). `norm`: the norm whose output x is, not yet run (gate|up's activation
    pass runs it where it can)."""
    out = mlp_decode(x, w.gate_up_proj, w.down_proj, norm)
    if out is not None:
        return out
    fused = swiglu_with_operand(x, w.gate_up_proj, decode_operand_spec(x, w.down_proj), norm)
    if fused is None:
        return silu_mul_linear(linear(x, w.gate_up_proj, norm=norm), w.down_proj)
    hidden, operand = fused
    return linear(hidden, w.down_proj, operand)


def sparse_moe(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig,
               norm: DeferredNorm | None = None) -> torch.Tensor:
    """Routed experts (top-k, renormalised) plus the sigmoid-gated shared expert. The router's
    kernel can write x's operand for the experts' gate|up stage, and run `norm` (the norm
    whose output x is, not yet run)."""
    weights, ids, operand = router(
        x, w.router_and_gate, cfg.num_experts_per_tok, True,
        gate_up_operand_spec(x, w.experts_gate_up, w.experts_down), cfg.num_experts + 1, norm)
    return moe_experts(x, w.experts_gate_up, w.experts_down, weights, ids, operand)


def _add_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor, DeferredNorm | None]:
    """(x + h, its RMSNorm, None) (x and its norm with h None); where the norm can wait for
    the launch of its reader (ops.norm.DeferredNorm: the Triton kernels), the buffers it will
    write and the norm itself, which the caller hands to that reader."""
    norm = defer_add_rms_norm(x, h, weight, eps)
    if norm is not None:
        return norm.residual, norm.out, norm
    if h is None:
        return x, rms_norm(x, weight, eps), None
    return (*add_rms_norm(x, h, weight, eps), None)


def _ablated_operand(x: torch.Tensor, spec: tuple[int, bool] | None) -> DecodeOperand | None:
    """The decode operand of `spec` for x that an ablated op would write (ops.ablation)."""
    return None if spec is None else DecodeOperand.ablated(*x.shape, *spec, x.device)


def gated_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
               reader: Weight) -> tuple[torch.Tensor, DecodeOperand | None]:
    """The GDN output norm of x, z [T, heads, D], and its decode operand for `reader` (the
    out_proj that reads it as [T, heads * D]) where that runs the decode GEMV and the heads
    tile the operand's groups: written by the norm kernel, it spares the GEMV its own
    activation pass."""
    spec = decode_operand_spec(x.flatten(1), reader)
    if spec is None:
        return gated_rms_norm(x, z, weight, eps), None
    return gated_rms_norm_with_operand(x, z, weight, eps, *spec)


def decoder_layer(x: torch.Tensor, h: torch.Tensor | None, w: DecoderLayerWeights,
                  cache: LayerCache, batch: StepBatch, rope: Rope,
                  cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer on the residual stream x + h (h None: the stream is x alone).

    Returns the stream as (x, h), the MLP output h not yet added, so that the next layer's
    input norm adds it in the same pass (add_rms_norm); the sum is the one `x = x + h` makes.
    """
    eps = cfg.rms_norm_eps
    skip_norms = ablated("norm", x)
    # each norm is deferred to the first launch that reads it (ops.norm.DeferredNorm)
    if skip_norms:
        h, norm = x, None
    else:
        x, h, norm = _add_norm(x, h, w.input_layernorm, eps)
    if isinstance(w.mixer, AttentionWeights):
        assert isinstance(cache, PagedKV), "a full-attention layer needs a PagedKV cache"
        h = gated_attention(h, w.mixer, cache, batch, rope, cfg, norm)
    else:
        assert isinstance(cache, GDNSlots), "a GDN layer needs a GDNSlots cache"
        h = gated_delta_net(h, w.mixer, cache, batch, cfg, norm)
    if skip_norms:
        h, norm = x, None
    else:
        x, h, norm = _add_norm(x, h, w.post_attention_layernorm, eps)
    h = sparse_moe(h, w.mlp, cfg, norm) if isinstance(w.mlp, MoEWeights) else mlp(h, w.mlp, norm)
    return x, h


def run_layers(x: torch.Tensor, layers: Sequence[DecoderLayerWeights],
               caches: Sequence[LayerCache], batch: StepBatch, cfg: ModelConfig,
               final_norm: torch.Tensor, taps: Sequence[int] = ()
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Push the step's tokens x [N, H] through `layers`, each over its cache.

    Returns the residual stream after the last layer normed by `final_norm` [N, H] (the last
    residual add in the norm's pass) and the taps: the stream after each layer in `taps`
    (0-based layer ids, in that order), concatenated [N, len(taps) * H].
    """
    if len(layers) != len(caches):
        raise ValueError(f"{len(caches)} layer caches for {len(layers)} layers")
    if any(not 0 <= i < len(layers) for i in taps):
        raise ValueError(f"tap layer ids {list(taps)} outside the {len(layers)} layers")
    rope = rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    h = None
    tapped: dict[int, torch.Tensor] = {}
    for i, (w, cache) in enumerate(zip(layers, caches, strict=True)):
        x, h = decoder_layer(x, h, w, cache, batch, rope, cfg)
        if i in taps:
            tapped[i] = x + h
    eps = cfg.rms_norm_eps
    out = rms_norm(x, final_norm, eps) if h is None else add_rms_norm(x, h, final_norm, eps)[1]
    if not taps:
        return out, x.new_empty(x.shape[0], 0)
    return out, torch.cat([tapped[i] for i in taps], dim=-1)
