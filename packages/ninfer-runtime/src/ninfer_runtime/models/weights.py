"""The NInfer-named weights a Qwen3.5 model reads, grouped per block and checked on load.

Names and layouts are those of ninfer_convert.mapping (fused qkvz / ba / qkv / gate_up,
stacked experts, conv1d [C, K], fp32 A_log and dt_bias). Loading checks every tensor's
presence and logical shape, so a wrong artifact fails here naming the tensor, never later
inside an op. Plain tensors are moved to the compute dtype and device once; packed
(quantized) weights are only moved, the ops dequantize them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ninfer_runtime.config import ModelConfig
from ninfer_runtime.ops.linear import Weight
from ninfer_runtime.ops.quant_linear import group_major
from ninfer_runtime.quant import PackedWeight


class WeightError(KeyError):
    """A missing tensor or one whose shape does not match the model config."""

    def __str__(self) -> str:
        return str(self.args[0])


class WeightReader:
    """Takes tensors from a weights mapping, checking names and shapes and converting them."""

    def __init__(self, weights: Mapping[str, Weight], dtype: torch.dtype,
                 device: torch.device | str):
        self._weights = weights
        self.dtype = dtype
        self.device = torch.device(device)

    def take(self, name: str, shape: tuple[int, ...], *, fp32: bool = False,
             packed: bool = False) -> Weight:
        """The tensor `name` of logical `shape`; `packed` allows a PackedWeight; `fp32` keeps
        a plain tensor in fp32 whatever the compute dtype."""
        try:
            w = self._weights[name]
        except KeyError:
            raise WeightError(f"weights lack the tensor {name!r}") from None
        actual = tuple(w.shape)
        if actual != shape:
            raise WeightError(f"tensor {name!r} has shape {actual}, the config expects {shape}")
        if isinstance(w, PackedWeight):
            if not packed:
                raise WeightError(f"tensor {name!r} is quantized ({w.scheme.name}); "
                                  "NInfer keeps it unquantized")
            return w.to(self.device)
        return w.to(self.device, torch.float32 if fp32 else self.dtype)

    def norm(self, name: str, dim: int) -> torch.Tensor:
        return self.take(name, (dim,))

    def linear(self, name: str, out: int, inp: int) -> Weight:
        """A linear layer's weight [out, in]; a groupwise-int one with its scales stored as
        the decode kernels read them best (`quant_linear.group_major`)."""
        w = self.take(name, (out, inp), packed=True)
        return group_major(w) if isinstance(w, PackedWeight) else w


@dataclass(frozen=True)
class AttentionWeights:
    qkv_proj: Weight  # [nq*2*hd + 2*nkv*hd, H]: per q head [q | gate], then k, then v
    o_proj: Weight  # [H, nq*hd]
    q_norm: torch.Tensor  # [hd], zero-centred
    k_norm: torch.Tensor

    @classmethod
    def load(cls, r: WeightReader, p: str, cfg: ModelConfig) -> AttentionWeights:
        hd, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        return cls(
            qkv_proj=r.linear(p + "qkv_proj.weight", (2 * nq + 2 * nkv) * hd, cfg.hidden_size),
            o_proj=r.linear(p + "o_proj.weight", cfg.hidden_size, nq * hd),
            q_norm=r.norm(p + "q_norm.weight", hd),
            k_norm=r.norm(p + "k_norm.weight", hd),
        )


@dataclass(frozen=True)
class GDNWeights:
    in_proj_qkvz: Weight  # [conv_dim + value_dim, H]: q | k | v | z
    in_proj_ba: torch.Tensor  # [2*nv, H]: b | a
    conv1d: torch.Tensor  # [conv_dim, K]
    A_log: torch.Tensor  # [nv] fp32
    dt_bias: torch.Tensor  # [nv] fp32
    norm: torch.Tensor  # [dv], plain weight
    out_proj: Weight  # [H, value_dim]

    @classmethod
    def load(cls, r: WeightReader, p: str, cfg: ModelConfig) -> GDNWeights:
        nv, h = cfg.linear_num_value_heads, cfg.hidden_size
        return cls(
            in_proj_qkvz=r.linear(p + "in_proj_qkvz.weight",
                                  cfg.conv_dim + cfg.linear_value_dim, h),
            in_proj_ba=r.take(p + "in_proj_ba.weight", (2 * nv, h)),
            conv1d=r.take(p + "conv1d.weight", (cfg.conv_dim, cfg.linear_conv_kernel_dim)),
            A_log=r.take(p + "A_log", (nv,), fp32=True),
            dt_bias=r.take(p + "dt_bias", (nv,), fp32=True),
            norm=r.norm(p + "norm.weight", cfg.linear_value_head_dim),
            out_proj=r.linear(p + "out_proj.weight", h, cfg.linear_value_dim),
        )


@dataclass(frozen=True)
class MLPWeights:
    gate_up_proj: Weight  # [2I, H]: gate rows then up rows
    down_proj: Weight  # [H, I]

    @classmethod
    def load(cls, r: WeightReader, p: str, hidden: int, inter: int) -> MLPWeights:
        return cls(r.linear(p + "gate_up_proj.weight", 2 * inter, hidden),
                   r.linear(p + "down_proj.weight", hidden, inter))


# A prompt's router GEMM gives logits [T, E + 1] (257 columns on the 35B-A3B): rows of 514
# bytes, not 16-byte aligned, which cuBLAS multiplies on an old slow path. The 35B's 8K prefill
# spent 7.4 ms (2.0%) in `cutlass_75_tensorop_s1688gemm_bf16_128x128_tn_al..` at ~47 TFLOP/s,
# the one GEMM of its kind there (docs/perf.md, eleventh run; the router's by elimination,
# untimed since). Zero rows up to a multiple of 8 keep every row aligned; the router reads
# the first E + 1 columns.
ROUTER_ROWS = 8


@dataclass(frozen=True)
class MoEWeights:
    """The routed experts with the shared expert stacked after them as expert E: one MoE pass
    runs both, the shared expert in a slot of its own weighted by sigmoid(its gate) (ops.moe
    `route(..., shared=True)`), which takes the shared expert's five kernels and its gating's
    two off every layer."""

    # the router's E rows, then the shared expert's gate row (one GEMM gives both), then zero
    # rows to a multiple of ROUTER_ROWS (see there)
    router_and_gate: torch.Tensor  # [E + 1 rounded up, H]
    experts_gate_up: Weight  # [E + 1, 2I, H]
    experts_down: Weight  # [E + 1, H, I]

    @classmethod
    def load(cls, r: WeightReader, p: str, cfg: ModelConfig) -> MoEWeights:
        e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if cfg.shared_expert_intermediate_size != inter:
            raise WeightError(
                f"{p}: the shared expert's intermediate size "
                f"{cfg.shared_expert_intermediate_size} differs from the routed experts' {inter}; "
                "NInfer runs the shared expert stacked with them (every Qwen3.5/3.6 MoE has them "
                "equal)")
        shared = MLPWeights.load(r, p + "shared_expert.", h, inter)
        gate = r.take(p + "shared_expert_gate.weight", (1, h))
        return cls(
            router_and_gate=torch.cat([r.take(p + "router.weight", (e, h)), gate,
                                       gate.new_zeros(-(e + 1) % ROUTER_ROWS, h)]),
            experts_gate_up=_stack(r.take(p + "experts.gate_up_proj", (e, 2 * inter, h),
                                          packed=True), shared.gate_up_proj),
            experts_down=_stack(r.take(p + "experts.down_proj", (e, h, inter), packed=True),
                                shared.down_proj),
        )


def _stack(experts: Weight, extra: Weight) -> Weight:
    """experts [E, N, K] with `extra` [N, K] appended as expert E (plain or packed alike)."""
    if isinstance(experts, PackedWeight) != isinstance(extra, PackedWeight):
        raise WeightError("the shared expert and the routed experts are stored differently "
                          "(one packed, one not)")
    if not isinstance(experts, PackedWeight):
        return torch.cat([experts, extra[None]])
    if experts.scheme.name != extra.scheme.name or experts.parts.keys() != extra.parts.keys():
        raise WeightError(f"the shared expert is {extra.scheme.name}, the routed experts "
                          f"{experts.scheme.name}")
    parts = {role: torch.cat([part, extra.parts[role][None]])
             for role, part in experts.parts.items()}
    return PackedWeight(experts.scheme, parts, (experts.shape[0] + 1, *experts.shape[1:]))


@dataclass(frozen=True)
class DecoderLayerWeights:
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    mixer: AttentionWeights | GDNWeights  # token mixer: gated attention or Gated DeltaNet
    mlp: MLPWeights | MoEWeights

    @classmethod
    def load(cls, r: WeightReader, p: str, cfg: ModelConfig,
             full_attention: bool) -> DecoderLayerWeights:
        h = cfg.hidden_size
        mixer = (AttentionWeights.load(r, p + "self_attn.", cfg) if full_attention
                 else GDNWeights.load(r, p + "linear_attn.", cfg))
        mlp = (MoEWeights.load(r, p + "mlp.", cfg) if cfg.is_moe
               else MLPWeights.load(r, p + "mlp.", h, cfg.intermediate_size))
        return cls(r.norm(p + "input_layernorm.weight", h),
                   r.norm(p + "post_attention_layernorm.weight", h), mixer, mlp)
