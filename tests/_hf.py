"""Tiny random Hugging Face Qwen3.5 models as oracles, and their weights under NInfer names.

Every parameter is randomised (transformers zero-initialises the (1 + w) norms and sets A_log /
dt_bias to fixed ranges, which would leave those code paths untested), scaled so activations
stay O(1). The HF state dict is mapped to NInfer names with ninfer_convert.mapping.plan_tensors,
performing the same concat / stack / squeeze the converter does.
"""

from __future__ import annotations

import copy
import math
from functools import cache
from typing import Any

import torch

from ninfer_convert.mapping import plan_tensors
from ninfer_runtime.config import FULL_ATTENTION, ModelConfig
from ninfer_runtime.profiles import get_profile


def _random_like(name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen) * std

    if name.endswith("A_log"):  # decay rates A in [0.02, 2]: short and long memories
        return (torch.rand(t.shape, generator=gen) * 1.98 + 0.02).log()
    if name.endswith("dt_bias"):
        return normal(1.0)
    if name.endswith("linear_attn.norm.weight"):  # plain-weight gated norm
        return 1.0 + normal(0.3)
    if t.dim() == 1:  # zero-centred (1 + w) norms
        return normal(0.3)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith("mlp.gate.weight"):  # router: well separated expert scores
        return normal(3.0 / math.sqrt(t.shape[-1]))
    return normal(1.0 / math.sqrt(t.shape[-1]))  # conv1d [C, 1, K] and every linear


def randomize(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: _random_like(name, t, gen) for name, t in sorted(state.items())}


def _hf_classes(moe: bool) -> tuple[type, type, type]:
    if moe:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer,
        )
        return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeDecoderLayer
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    return Qwen3_5TextConfig, Qwen3_5ForCausalLM, Qwen3_5DecoderLayer


@cache
def hf_model(profile: str, seed: int = 0, rope: tuple[tuple[str, Any], ...] = ()
             ) -> tuple[torch.nn.Module, ModelConfig]:
    """A randomised fp32 Qwen3_5(Moe)ForCausalLM for a tiny profile, and NInfer's config;
    `rope` updates the rope_parameters of both (YaRN scaling, say). The weights depend on the
    profile and the seed only."""
    p = get_profile(profile)
    hf = copy.deepcopy(p.hf_config)
    hf["text_config"]["rope_parameters"].update(rope)
    config_cls, model_cls, _ = _hf_classes(p.config.is_moe)
    model = model_cls(config_cls(**hf["text_config"])).float().eval()
    model.load_state_dict(randomize(model.state_dict(), seed))
    return model, ModelConfig.from_hf(hf)


def hf_mtp_state(profile: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random mtp.* tensors under HF checkpoint names (one full-attention decoder layer)."""
    p = get_profile(profile)
    config_cls, _, layer_cls = _hf_classes(p.config.is_moe)
    full = p.config.layer_types.index(FULL_ATTENTION)
    layer = layer_cls(config_cls(**p.hf_config["text_config"]), full)
    h = p.config.hidden_size
    state = {f"mtp.layers.0.{n}": t for n, t in layer.state_dict().items()}
    state["mtp.fc.weight"] = torch.empty(h, 2 * h)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        state[f"mtp.{norm}.weight"] = torch.empty(h)
    return randomize(state, seed)


def quantizable_names(profile: str) -> list[str]:
    """The NInfer weights of `hf_model(profile)` that take the body's quantization."""
    model, cfg = hf_model(profile)
    return [p.name for p in plan_tensors(cfg, set(model.state_dict()), include_vision=False)
            if p.quantizable]


def to_ninfer(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors -> NInfer-named tensors (fp32), through the converter's tensor plan."""
    out = {}
    for plan in plan_tensors(cfg, set(hf_state), include_vision=False):
        src = [hf_state[s] for s in plan.sources]
        if plan.combine == "one":
            t = src[0]
        elif plan.combine == "concat":
            t = torch.cat(src, dim=0)
        elif plan.combine == "stack":
            t = torch.stack(src)
        elif plan.combine == "stack_concat":
            t = torch.stack([torch.cat(src[i:i + plan.parts], dim=0)
                             for i in range(0, len(src), plan.parts)])
        else:  # squeeze1
            t = src[0].squeeze(1)
        out[plan.name] = t.detach().float().clone()
    return out


@cache
def ninfer_weights(profile: str, with_mtp: bool = False) -> dict[str, torch.Tensor]:
    """The NInfer weights of `hf_model(profile)` (plus random MTP weights if asked)."""
    model, cfg = hf_model(profile)
    state = dict(model.state_dict())
    if with_mtp:
        state.update(hf_mtp_state(profile))
    return to_ninfer(cfg, state)
