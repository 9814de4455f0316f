"""The DFlash draft of `ninfer-convert build ... --dflash DRAFT`: where it comes from, what it
must match, and the names it is packed under.

DRAFT is a z-lab-format checkpoint (config.json + safetensors, tensor names without a `model.`
prefix; specdecode.md A.7) as a directory or a hub repo id, or `random`: random weights shaped
like the z-lab drafts for the target (`random_draft_config`). The draft is checked against the
target before anything is written: hidden size, vocabulary, number of target layers, tapped
layers and mask token (models.dflash.DFlashConfig.check_target).

| NInfer tensor (under dflash.)                      | z-lab tensor                         |
|----------------------------------------------------|--------------------------------------|
| fc.weight [Q]                                      | fc.weight [H, len(taps) * H]         |
| hidden_norm.weight, norm.weight                    | same                                 |
| layers.i.{input,post_attention}_layernorm.weight   | same                                 |
| layers.i.self_attn.q_proj.weight [Q]               | same                                 |
| layers.i.self_attn.kv_proj.weight [Q]              | cat(k_proj, v_proj) along rows       |
| layers.i.self_attn.o_proj.weight [Q]               | same                                 |
| layers.i.self_attn.{q,k}_norm.weight               | same                                 |
| layers.i.mlp.gate_up_proj.weight [Q]               | cat(gate_proj, up_proj)              |
| layers.i.mlp.down_proj.weight [Q]                  | same                                 |

[Q]: quantized with the artifact's --weights scheme, like the target's body; norms stay bf16.
k and v are fused because the context path projects only them, the block path all three.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ninfer_convert import hub
from ninfer_convert.checkpoint import Checkpoint, ConvertError
from ninfer_convert.mapping import TensorPlan
from ninfer_convert.sources import (
    REPO_ID,
    ModelSource,
    RandomTensors,
    Shape,
    TensorStore,
    describe_origin,
    read_json_object,
)
from ninfer_runtime.config import FULL_ATTENTION, ModelConfig
from ninfer_runtime.models.dflash import (
    DRAFT_ARCHITECTURE,
    PREFIX,
    SLIDING_ATTENTION,
    DFlashConfig,
    DFlashConfigError,
    build_target_layer_ids,
)

RANDOM = "random"
STORE_PREFIX = "dflash:"  # the draft's tensors among the converter's sources
# The random draft: z-lab's Qwen3.6 layout (4 sliding layers, then one full), block 16.
RANDOM_LAYERS = 5
QWEN_VOCAB, QWEN_MASK = 248320, 248070
# Tiny profiles: 1026 follows the tiny stand-in tokenizer's 26 added tokens (1000..1025) as
# 248070 follows the Qwen ones (248044..248069); the window is short enough for tests to cross.
TINY_MASK, TINY_WINDOW, WINDOW = 1026, 32, 2048


class DFlashError(ConvertError):
    """A --dflash DRAFT that cannot be read or does not fit the target."""


@dataclass(frozen=True)
class DFlashSource:
    config: DFlashConfig
    hf_config: dict[str, Any]  # the draft's config.json as it came
    store: TensorStore  # z-lab tensor names
    origin: dict[str, Any]  # kind + path, repo_id / revision, or seed

    @property
    def where(self) -> str:
        return describe_origin(self.origin)

    def plans(self) -> list[TensorPlan]:
        """The dflash.* outputs, their sources named as in the merged store (STORE_PREFIX)."""
        plans = [TensorPlan(PREFIX + "fc.weight", (STORE_PREFIX + "fc.weight",), "one", "body"),
                 *(_keep(n) for n in ("hidden_norm.weight", "norm.weight"))]
        for i in range(self.config.num_layers):
            p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            plans += [
                _keep(p + "input_layernorm.weight"), _keep(p + "post_attention_layernorm.weight"),
                _body(a + "q_proj.weight", a + "q_proj.weight"),
                _body(a + "kv_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                _body(a + "o_proj.weight", a + "o_proj.weight"),
                _keep(a + "q_norm.weight"), _keep(a + "k_norm.weight"),
                _body(m + "gate_up_proj.weight", m + "gate_proj.weight", m + "up_proj.weight"),
                _body(m + "down_proj.weight", m + "down_proj.weight"),
            ]
        return plans

    def layout(self) -> dict[str, tuple[Shape, str]]:
        """Every z-lab tensor the config implies: name -> (shape, dtype tag)."""
        return draft_layout(self.config)

    def manifest(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "hf_config": self.hf_config,
                "source": self.origin, "random_init": self.origin["kind"] == "random-init"}


def _keep(name: str) -> TensorPlan:
    return TensorPlan(PREFIX + name, (STORE_PREFIX + name,), "one", "keep")


def _body(name: str, *sources: str) -> TensorPlan:
    return TensorPlan(PREFIX + name, tuple(STORE_PREFIX + s for s in sources),
                      "concat" if len(sources) > 1 else "one", "body")


def draft_layout(cfg: DFlashConfig) -> dict[str, tuple[Shape, str]]:
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, Shape] = {"fc.weight": (h, cfg.tap_width), "hidden_norm.weight": (h,),
                                "norm.weight": (h,)}
    for i in range(cfg.num_layers):
        shapes |= {f"layers.{i}.{n}": s for n, s in (
            ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,)),
            ("self_attn.q_proj.weight", (q, h)), ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, q)),
            ("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,)),
            ("mlp.gate_proj.weight", (inter, h)), ("mlp.up_proj.weight", (inter, h)),
            ("mlp.down_proj.weight", (h, inter)))}
    return {name: (shape, "BF16") for name, shape in shapes.items()}


def random_draft_config(target: ModelConfig) -> dict[str, Any]:
    """A z-lab-style config.json for a random draft of `target`: 5 layers (4 sliding, 1 full),
    taps from build_target_layer_ids, block 16; 32 x 128 attention heads (8 kv) like z-lab's
    drafts at real sizes, the target's own head shape at toy sizes (hidden < 1024)."""
    h = target.hidden_size
    tiny = h < 1024
    heads, kv, hd = ((target.num_attention_heads, target.num_key_value_heads, target.head_dim)
                     if tiny else (32, 8, 128))
    mask = QWEN_MASK if target.vocab_size == QWEN_VOCAB else min(TINY_MASK, target.vocab_size - 1)
    return {
        "architectures": [DRAFT_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": h,
        "num_hidden_layers": RANDOM_LAYERS,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "intermediate_size": target.intermediate_size or 3 * h,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000_000,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "num_target_layers": target.num_layers,
        "layer_types": [SLIDING_ATTENTION] * (RANDOM_LAYERS - 1) + [FULL_ATTENTION],
        "sliding_window": TINY_WINDOW if tiny else WINDOW,
        "tie_word_embeddings": False,
        "block_size": 16,
        "dflash_config": {"mask_token_id": mask,
                          "target_layer_ids": list(build_target_layer_ids(target.num_layers,
                                                                          RANDOM_LAYERS))},
    }


def _draw(name: str, n: int, shape: Shape, gen: torch.Generator) -> torch.Tensor:
    """Random draft values: N(0, 0.02) for linears, 1 + N(0, 0.02) for the plain-w norms."""
    values = torch.randn(n, generator=gen, device=gen.device) * 0.02
    return values + 1.0 if len(shape) == 1 else values


def with_dflash(source: ModelSource, spec: str, *, seed: int = 0,
                revision: str | None = None, device: str = "cpu") -> ModelSource:
    """`source` with the DFlash draft DRAFT = `spec` to pack (see `open_dflash`)."""
    return replace(source, dflash=open_dflash(spec, source.config, seed=seed, revision=revision,
                                              device=device))


def open_dflash(spec: str, target: ModelConfig, *, seed: int = 0,
                revision: str | None = None, device: str = "cpu") -> DFlashSource:
    """Resolves --dflash DRAFT: `random` (drawn on `device`), then an existing directory,
    then a hub repo id."""
    if revision is not None and (spec == RANDOM or Path(spec).is_dir()):
        raise DFlashError("--dflash-revision applies only to a draft fetched from the hub")
    if spec == RANDOM:
        hf = random_draft_config(target)
        config = _parse(hf, "random draft", target)
        return DFlashSource(config, hf, RandomTensors(draft_layout(config), seed, _draw, device),
                            {"kind": "random-init", "seed": seed})
    path = Path(spec)
    if path.is_dir():
        return _local(path.resolve(), {"kind": "local", "path": str(path.resolve())}, target)
    if REPO_ID.fullmatch(spec) and not path.exists():
        directory, commit = hub.download(spec, revision)
        return _local(directory, {"kind": "hub", "repo_id": spec, "revision": commit}, target)
    raise DFlashError(f"--dflash {spec!r} is not {RANDOM!r}, a draft checkpoint directory or a "
                      "Hugging Face repo id (org/name)")


def _local(directory: Path, origin: dict[str, Any], target: ModelConfig) -> DFlashSource:
    file = directory / "config.json"
    hf = read_json_object(file, required=True, error=DFlashError,
                          kind="a DFlash draft checkpoint")
    config = _parse(hf, str(file), target)
    return DFlashSource(config, hf, Checkpoint(directory), origin)


def _parse(hf: dict[str, Any], where: str, target: ModelConfig) -> DFlashConfig:
    try:
        config = DFlashConfig.from_hf(hf)
    except DFlashConfigError as e:
        raise DFlashError(f"{where}: DFlash config: {e}") from None
    try:
        config.check_target(target)
    except DFlashConfigError as e:
        raise DFlashError(f"{where}: the DFlash draft does not fit the target: {e}") from None
    return config
