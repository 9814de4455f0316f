"""Hugging Face tensor names -> NInfer tensor names, declared as data.

NInfer names drop the `model.language_model.` prefix and fuse what the kernels read together:

| NInfer tensor (under layers.i.)        | built from (HF names under the text prefix)        |
|----------------------------------------|----------------------------------------------------|
| linear_attn.in_proj_qkvz.weight [Q]    | cat(in_proj_qkv, in_proj_z) along rows             |
| linear_attn.in_proj_ba.weight          | cat(in_proj_b, in_proj_a) along rows               |
| linear_attn.conv1d.weight [C, K]       | conv1d.weight [C, 1, K] squeezed                   |
| linear_attn.{A_log,dt_bias} (fp32)     | same                                               |
| linear_attn.out_proj.weight [Q]        | same                                               |
| self_attn.qkv_proj.weight [Q]          | cat(q_proj (q|gate per head), k_proj, v_proj)      |
| self_attn.o_proj.weight [Q]            | same                                               |
| mlp.gate_up_proj.weight [Q]            | cat(gate_proj, up_proj)                            |
| mlp.down_proj.weight [Q]               | same                                               |
| mlp.router.weight                      | mlp.gate.weight                                    |
| mlp.experts.gate_up_proj [E,2I,H] [Q]  | fused experts.gate_up_proj, or per expert:         |
|                                        | stack_e(cat(experts.e.gate_proj, .up_proj))        |
| mlp.experts.down_proj [E,H,I] [Q]      | fused experts.down_proj, or stack_e(down_proj)     |
| mlp.shared_expert.gate_up_proj [Q]     | cat(shared_expert.gate_proj, .up_proj)             |
| mlp.shared_expert.down_proj [Q]        | same                                               |
| mlp.shared_expert_gate.weight          | same                                               |

Outside the layers: embed_tokens.weight, norm.weight and lm_head.weight keep their names
(lm_head comes from embed_tokens when tied); mtp.* keeps its names with the same fusions
(mtp.layers.0 is a full-attention layer); visual.* comes from model.visual.* as is.

[Q] marks the linear weights that take the body's quantization (`group` says which choice
applies: "body", "lm_head" or "mtp"); every other tensor stays bf16 (fp32 for A_log, dt_bias;
int64 for token ids such as draft_head.token_ids). The DFlash draft's names are in
ninfer_convert.dflash, the draft head's in ninfer_convert.draft_vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ninfer_runtime.config import FULL_ATTENTION, ModelConfig

Combine = Literal["one", "concat", "stack", "stack_concat", "squeeze1"]
Group = Literal["body", "lm_head", "mtp", "keep", "fp32", "int64"]

TEXT_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.")


@dataclass(frozen=True)
class TensorPlan:
    """One NInfer tensor and how to build it from source tensors.

    `sources` are HF names. For "concat" they are joined along the output-row dim; "stack"
    stacks one source per expert; "stack_concat" holds `parts` names per expert, concatenated
    then stacked; "squeeze1" drops dim 1 (conv1d).
    """

    name: str
    sources: tuple[str, ...]
    combine: Combine
    group: Group
    parts: int = 1

    @property
    def quantizable(self) -> bool:
        return self.group in ("body", "lm_head", "mtp")


def _text_prefix(names: set[str]) -> str:
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise KeyError("embed_tokens.weight")


def _layer_plans(cfg: ModelConfig, src: str, dst: str, full: bool, names: set[str],
                 group: Group) -> list[TensorPlan]:
    """Plans for one decoder layer: `src`/`dst` are the HF and NInfer layer prefixes."""
    keep = lambda n: TensorPlan(dst + n, (src + n,), "one", "keep")  # noqa: E731
    plans = [keep("input_layernorm.weight"), keep("post_attention_layernorm.weight")]
    if full:
        a, b = src + "self_attn.", dst + "self_attn."
        plans += [
            TensorPlan(b + "qkv_proj.weight",
                       (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                       "concat", group),
            TensorPlan(b + "o_proj.weight", (a + "o_proj.weight",), "one", group),
            keep("self_attn.q_norm.weight"), keep("self_attn.k_norm.weight"),
        ]
    else:
        a, b = src + "linear_attn.", dst + "linear_attn."
        plans += [
            TensorPlan(b + "in_proj_qkvz.weight",
                       (a + "in_proj_qkv.weight", a + "in_proj_z.weight"), "concat", group),
            TensorPlan(b + "in_proj_ba.weight",
                       (a + "in_proj_b.weight", a + "in_proj_a.weight"), "concat", "keep"),
            TensorPlan(b + "conv1d.weight", (a + "conv1d.weight",), "squeeze1", "keep"),
            TensorPlan(b + "A_log", (a + "A_log",), "one", "fp32"),
            TensorPlan(b + "dt_bias", (a + "dt_bias",), "one", "fp32"),
            keep("linear_attn.norm.weight"),
            TensorPlan(b + "out_proj.weight", (a + "out_proj.weight",), "one", group),
        ]
    m, d = src + "mlp.", dst + "mlp."
    if not cfg.is_moe:
        return plans + [
            TensorPlan(d + "gate_up_proj.weight", (m + "gate_proj.weight", m + "up_proj.weight"),
                       "concat", group),
            TensorPlan(d + "down_proj.weight", (m + "down_proj.weight",), "one", group),
        ]
    plans += [
        TensorPlan(d + "router.weight", (m + "gate.weight",), "one", "keep"),
        TensorPlan(d + "shared_expert.gate_up_proj.weight",
                   (m + "shared_expert.gate_proj.weight", m + "shared_expert.up_proj.weight"),
                   "concat", group),
        TensorPlan(d + "shared_expert.down_proj.weight",
                   (m + "shared_expert.down_proj.weight",), "one", group),
        keep("mlp.shared_expert_gate.weight"),
    ]
    if m + "experts.gate_up_proj" in names:  # fused 3-D layout
        return plans + [
            TensorPlan(d + "experts.gate_up_proj", (m + "experts.gate_up_proj",), "one", group),
            TensorPlan(d + "experts.down_proj", (m + "experts.down_proj",), "one", group),
        ]
    experts = range(cfg.num_experts)
    e = m + "experts.{}."
    return plans + [
        TensorPlan(d + "experts.gate_up_proj",
                   tuple(n for i in experts for n in (e.format(i) + "gate_proj.weight",
                                                      e.format(i) + "up_proj.weight")),
                   "stack_concat", group, parts=2),
        TensorPlan(d + "experts.down_proj",
                   tuple(e.format(i) + "down_proj.weight" for i in experts), "stack", group),
    ]


def lm_head_source(names: set[str]) -> str:
    """The HF tensor lm_head.weight is built from: its own, or the embedding when tied."""
    return "lm_head.weight" if "lm_head.weight" in names else \
        _text_prefix(names) + "embed_tokens.weight"


def plan_tensors(cfg: ModelConfig, names: set[str], *, include_mtp: bool = True,
                 include_vision: bool = True) -> list[TensorPlan]:
    """The NInfer tensors of a checkpoint whose tensor names are `names`, in write order.

    Raises KeyError naming the first HF tensor the config requires but the checkpoint lacks.
    """
    text = _text_prefix(names)
    plans = [TensorPlan("embed_tokens.weight", (text + "embed_tokens.weight",), "one", "keep")]
    for i, kind in enumerate(cfg.layer_types):
        plans += _layer_plans(cfg, f"{text}layers.{i}.", f"layers.{i}.", kind == FULL_ATTENTION,
                              names, "body")
    plans.append(TensorPlan("norm.weight", (text + "norm.weight",), "one", "keep"))
    plans.append(TensorPlan("lm_head.weight", (lm_head_source(names),), "one", "lm_head"))
    if include_mtp and cfg.mtp_num_hidden_layers and "mtp.fc.weight" in names:
        plans += [
            TensorPlan("mtp.fc.weight", ("mtp.fc.weight",), "one", "mtp"),
            *(TensorPlan(f"mtp.{n}.weight", (f"mtp.{n}.weight",), "one", "keep")
              for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")),
        ]
        for j in range(cfg.mtp_num_hidden_layers):
            plans += _layer_plans(cfg, f"mtp.layers.{j}.", f"mtp.layers.{j}.", True, names, "mtp")
    if include_vision:
        for n in sorted(names):
            for prefix in VISION_PREFIXES:
                if n.startswith(prefix):
                    plans.append(TensorPlan("visual." + n[len(prefix):], (n,), "one", "keep"))
    missing = [s for p in plans for s in p.sources if s not in names]
    if missing:
        raise KeyError(missing[0])
    return plans
