"""The model configuration NInfer runs, read once from a Hugging Face config dict.

`ModelConfig.from_hf` is the only place that interprets Hugging Face config keys; everything
else in NInfer reads the typed fields below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class ConfigError(ValueError):
    """A config that is not a Qwen3.5-family text model NInfer can run."""


ROPE_TYPES = ("default", "linear", "yarn")
# rope_parameters keys that are not the scaling's: the base, the rotated share of a head, mRoPE
_NOT_SCALING = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def rope_scaling(params: dict[str, Any], max_positions: int | None
                 ) -> dict[str, Any] | None:
    """The `scaling` of `ops.rope.rope_inv_freq` from a Hugging Face rope_parameters
    (transformers 5) or rope_scaling dict: None for plain RoPE, else its type and every
    parameter it needs, original_max_position_embeddings defaulting to `max_positions` as
    transformers does. ValueError for a type not computed there or a missing parameter: a
    model must not run silently on positions it was not made for."""
    params = {k: v for k, v in params.items() if k not in _NOT_SCALING}
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "mrope":  # transformers 4's name for plain mRoPE, as transformers reads it
        kind = "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    if params.get("factor") is None:
        raise ValueError(f"{kind} rope scaling lacks its 'factor'")
    if params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = max_positions
    if kind == "yarn" and params["original_max_position_embeddings"] is None:
        raise ValueError("yarn rope scaling lacks original_max_position_embeddings")
    return {"rope_type": kind, **params}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "qwen3_5" (dense) or "qwen3_5_moe"
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP (dense) or MoE
    intermediate_size: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int | None
    shared_expert_intermediate_size: int | None
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    eos_token_ids: tuple[int, ...]
    # RoPE scaling (`rope_scaling`): None, or YaRN / linear past the trained context
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # the whole Hugging Face config (text, vision, token ids) as it came, for the artifact
    hf_config: dict[str, Any] = field(compare=False, repr=False, default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def context_limit(self) -> int:
        """The positions the model is made for: max_position_embeddings, or with RoPE
        scaling its original context times the factor (as vLLM derives max_model_len)."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        base = self.rope_scaling["original_max_position_embeddings"]
        return int(base * float(self.rope_scaling["factor"]))

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q | k | v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def vision_config(self) -> dict[str, Any] | None:
        return self.hf_config.get("vision_config")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a top-level (`qwen3_5`, with `text_config`) or a text-only config."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not a Qwen3.5-family model "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        text = hf.get("text_config", hf)
        try:
            return cls._from_text(text, hf)
        except KeyError as missing:
            raise ConfigError(f"config lacks the key {missing} of a Qwen3.5-family model") from None

    @classmethod
    def _from_text(cls, t: dict[str, Any], hf: dict[str, Any]) -> ModelConfig:
        num_layers = t["num_hidden_layers"]
        interval = t.get("full_attention_interval", 4)
        layer_types = tuple(
            t.get("layer_types")
            or [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                for i in range(num_layers)]
        )
        if len(layer_types) != num_layers or set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
            raise ConfigError(f"layer_types {layer_types} does not describe {num_layers} layers")
        rope = t.get("rope_parameters") or {  # transformers 4's keys
            "rope_theta": t.get("rope_theta", 10_000_000),
            "partial_rotary_factor": t.get("partial_rotary_factor", 0.25),
            **(t.get("rope_scaling") or {}),
        }
        max_positions = t.get("max_position_embeddings", 262144)
        try:
            scaling = rope_scaling(rope, max_positions)
        except ValueError as e:
            raise ConfigError(f"rope_parameters: {e}") from None
        is_moe = "moe" in str(t.get("model_type", hf.get("model_type")))
        eos = t.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type="qwen3_5_moe" if is_moe else "qwen3_5",
            vocab_size=t["vocab_size"],
            hidden_size=t["hidden_size"],
            layer_types=layer_types,
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            num_attention_heads=t["num_attention_heads"],
            num_key_value_heads=t["num_key_value_heads"],
            head_dim=t.get("head_dim", 256),
            rope_theta=float(rope.get("rope_theta", 10_000_000)),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
            mrope_section=tuple(rope.get("mrope_section", ())),
            max_position_embeddings=max_positions,
            linear_num_key_heads=t["linear_num_key_heads"],
            linear_num_value_heads=t["linear_num_value_heads"],
            linear_key_head_dim=t["linear_key_head_dim"],
            linear_value_head_dim=t["linear_value_head_dim"],
            linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
            intermediate_size=None if is_moe else t["intermediate_size"],
            num_experts=t["num_experts"] if is_moe else 0,
            num_experts_per_tok=t["num_experts_per_tok"] if is_moe else 0,
            moe_intermediate_size=t["moe_intermediate_size"] if is_moe else None,
            shared_expert_intermediate_size=(
                t.get("shared_expert_intermediate_size") if is_moe else None
            ),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", hf.get("tie_word_embeddings"))),
            mtp_num_hidden_layers=t.get("mtp_num_hidden_layers", 0),
            eos_token_ids=eos_ids,
            rope_scaling=scaling,
            hf_config=hf,
        )
