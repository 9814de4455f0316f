"""Where a model comes from: a registered profile, a hub repo, a local directory, or random init.

`open_source` turns the SOURCE argument of `ninfer-convert build` into a `ModelSource`: the
Hugging Face config, generation config, tokenizer and chat template, what the manifest records
about the origin, and a tensor store (`load(name) -> {role: tensor}`) for the converter to
stream from. Random init generates each tensor on demand from (seed, name), so a 27B random
model costs no more memory than a real one and every tensor is reproducible on its own.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ninfer_convert import hub
from ninfer_convert.checkpoint import DTYPES, Checkpoint, ConvertError, SourceTensor
from ninfer_runtime.config import FULL_ATTENTION, ConfigError, ModelConfig
from ninfer_runtime.profiles import PROFILES, Profile
from ninfer_runtime.tokenizer import load_standin

if TYPE_CHECKING:
    from ninfer_convert.dflash import DFlashSource
    from ninfer_convert.draft_vocab import DraftVocab

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
TEXT = "model.language_model."
VISION = "model.visual."
Shape = tuple[int, ...]


class SourceError(ConvertError):
    """A SOURCE that names no usable model (unknown profile, not a Qwen3.5 checkpoint, ...)."""


class TensorStore(Protocol):
    tensors: dict[str, SourceTensor]

    def load(self, name: str) -> dict[str, torch.Tensor]: ...


class MergedStore:
    """Several stores as one; each store's tensor names get its prefix ("" keeps them)."""

    def __init__(self, stores: dict[str, TensorStore]):
        self._stores = stores
        self.tensors = {prefix + name: replace(t, name=prefix + name)
                        for prefix, store in stores.items() for name, t in store.tensors.items()}

    def load(self, name: str) -> dict[str, torch.Tensor]:
        for prefix, store in self._stores.items():
            if prefix and name.startswith(prefix):
                return store.load(name[len(prefix):])
        return self._stores[""].load(name)


@dataclass(frozen=True)
class ModelSource:
    hf_config: dict[str, Any]
    generation_config: dict[str, Any]
    tokenizer_json: str | None
    chat_template: str | None
    store: TensorStore
    origin: dict[str, Any]  # the manifest's "source": kind + repo_id/revision, path or seed
    profile: str | None
    quantized: str | None = None  # "modelopt-nvfp4" for a ModelOpt NVFP4 export
    dflash: DFlashSource | None = None  # a DFlash draft to pack (--dflash)
    draft_vocab: DraftVocab | None = None  # the draft head's vocabulary (--lm-head-draft)

    @property
    def random_init(self) -> bool:
        return self.origin["kind"] == "random-init"

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    @property
    def where(self) -> str:
        """The origin in words, for messages."""
        return describe_origin(self.origin)


def describe_origin(o: dict[str, Any]) -> str:
    """A source's origin record (hub / local / random-init) in words."""
    if o["kind"] == "hub":
        return f"{o['repo_id']}@{o['revision']}"
    return o.get("path") or f"random-init(seed={o.get('seed')})"


def open_source(spec: str, *, random_init: bool = False, seed: int = 0,
                revision: str | None = None, device: str = "cpu") -> ModelSource:
    """Resolves SOURCE: a profile name, then an existing directory, then a hub repo id
    (`device`: where --random-init draws its values)."""
    profile = PROFILES.get(spec)
    if revision is not None and (random_init or Path(spec).is_dir()):
        raise SourceError("--revision applies only to sources fetched from the hub")
    if profile is not None:
        if random_init:
            return random_source(profile, seed, device)
        if profile.hf_repo is None:
            raise SourceError(f"profile {spec!r} has no Hugging Face repo; use --random-init")
        return hub_source(profile.hf_repo, revision, profile.name)
    if random_init:
        raise SourceError(f"--random-init needs a registered profile as SOURCE, not {spec!r} "
                          f"(profiles: {', '.join(PROFILES)})")
    path = Path(spec)
    if path.is_dir():
        return local_source(path.resolve(), {"kind": "local", "path": str(path.resolve())})
    if REPO_ID.fullmatch(spec) and not path.exists():
        named = next((p.name for p in PROFILES.values() if p.hf_repo == spec), None)
        return hub_source(spec, revision, named)
    raise SourceError(f"{spec!r} is not a registered profile ({', '.join(PROFILES)}), "
                      "a checkpoint directory or a Hugging Face repo id (org/name)")


def hub_source(repo_id: str, revision: str | None, profile: str | None) -> ModelSource:
    directory, commit = hub.download(repo_id, revision)
    return local_source(directory, {"kind": "hub", "repo_id": repo_id, "revision": commit},
                        profile)


def local_source(directory: Path, origin: dict[str, Any],
                 profile: str | None = None) -> ModelSource:
    """A checkpoint directory as save_pretrained / the hub lay it out."""
    hf_config = read_json_object(directory / "config.json", required=True)
    try:
        ModelConfig.from_hf(hf_config)
    except ConfigError as e:
        raise SourceError(f"{directory / 'config.json'}: {e}") from None
    quantized = _quantization(directory, hf_config)
    generation = read_json_object(directory / "generation_config.json")
    if not generation and profile is not None:
        generation = PROFILES[profile].generation_config
    tokenizer = directory / "tokenizer.json"
    return ModelSource(
        hf_config={k: v for k, v in hf_config.items() if k != "quantization_config"},
        generation_config=generation,
        tokenizer_json=tokenizer.read_text() if tokenizer.is_file() else None,
        chat_template=_chat_template(directory),
        store=Checkpoint(directory, nvfp4=quantized == "modelopt-nvfp4"),
        origin=origin,
        profile=profile,
        quantized=quantized,
    )


def random_source(profile: Profile, seed: int, device: str = "cpu") -> ModelSource:
    """The profile's exact architecture with random weights and the stand-in tokenizer."""
    tokenizer_json, template = load_standin("tiny" if profile.is_tiny else "qwen")
    return ModelSource(
        hf_config=profile.hf_config,
        generation_config=profile.generation_config,
        tokenizer_json=tokenizer_json,
        chat_template=template,
        store=RandomTensors(hf_layout(profile.config), seed, device=device),
        origin={"kind": "random-init", "seed": seed},
        profile=profile.name,
    )


def read_json_object(path: Path, *, required: bool = False,
                     error: type[ConvertError] | None = None,
                     kind: str = "a Hugging Face checkpoint") -> dict[str, Any]:
    """The JSON object in `path` ({} when it is missing and not `required`); a missing
    required file, invalid JSON or another JSON value raise `error` (SourceError), naming the
    file and, for a missing one, that its folder is not `kind`."""
    error = error or SourceError
    if not path.is_file():
        if required:
            raise error(f"{path.parent}: no {path.name}; not {kind}")
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data


def _chat_template(directory: Path) -> str | None:
    """chat_template.jinja (newer exports) or tokenizer_config.json's "chat_template", which
    may also be a list of named templates."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = read_json_object(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _quantization(directory: Path, hf_config: dict[str, Any]) -> str | None:
    """None for a plain checkpoint, "modelopt-nvfp4" for a ModelOpt NVFP4 export; any other
    quantized checkpoint is refused rather than converted into garbage."""
    qc = hf_config.get("quantization_config") or {}
    hq = read_json_object(directory / "hf_quant_config.json").get("quantization") or {}
    method = qc.get("quant_method") or ("modelopt" if hq else None)
    algo = qc.get("quant_algo") or hq.get("quant_algo")
    if method is None and algo is None:
        return None
    if method == "modelopt" and str(algo).upper() == "NVFP4":
        return "modelopt-nvfp4"
    raise SourceError(f"{directory}: quantized checkpoint (quant_method {method!r}, quant_algo "
                      f"{algo!r}) is not supported; convert the BF16 release or a ModelOpt NVFP4 "
                      "export")


def hf_layout(cfg: ModelConfig) -> dict[str, tuple[Shape, str]]:
    """Every tensor of the Hugging Face checkpoint `cfg` describes: name -> (shape, dtype tag),
    in the `Qwen3_5(Moe)ForConditionalGeneration` naming (experts fused), with mtp.* and the
    vision tower."""
    h = cfg.hidden_size
    out: dict[str, tuple[Shape, str]] = {f"{TEXT}embed_tokens.weight": ((cfg.vocab_size, h),
                                                                         "BF16")}
    for i, kind in enumerate(cfg.layer_types):
        out |= _layer_layout(cfg, f"{TEXT}layers.{i}.", kind == FULL_ATTENTION)
    out[f"{TEXT}norm.weight"] = ((h,), "BF16")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((cfg.vocab_size, h), "BF16")
    if cfg.mtp_num_hidden_layers:
        out["mtp.fc.weight"] = ((h, 2 * h), "BF16")
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{n}.weight"] = ((h,), "BF16")
        for j in range(cfg.mtp_num_hidden_layers):
            out |= _layer_layout(cfg, f"mtp.layers.{j}.", True)
    if cfg.vision_config:
        out |= _vision_layout(cfg.vision_config)
    return out


def _layer_layout(cfg: ModelConfig, p: str, full: bool) -> dict[str, tuple[Shape, str]]:
    h = cfg.hidden_size
    shapes: dict[str, Shape] = {"input_layernorm.weight": (h,),
                                "post_attention_layernorm.weight": (h,)}
    if full:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shapes |= {"self_attn.q_proj.weight": (2 * q, h), "self_attn.k_proj.weight": (kv, h),
                   "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                   "self_attn.q_norm.weight": (cfg.head_dim,),
                   "self_attn.k_norm.weight": (cfg.head_dim,)}
    else:
        nv, k = cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
        shapes |= {f"linear_attn.{n}": s for n, s in (
            ("in_proj_qkv.weight", (cfg.conv_dim, h)),
            ("in_proj_z.weight", (cfg.linear_value_dim, h)),
            ("in_proj_b.weight", (nv, h)), ("in_proj_a.weight", (nv, h)),
            ("conv1d.weight", (cfg.conv_dim, 1, k)), ("A_log", (nv,)), ("dt_bias", (nv,)),
            ("norm.weight", (cfg.linear_value_head_dim,)),
            ("out_proj.weight", (h, cfg.linear_value_dim)))}
    if not cfg.is_moe:
        i = cfg.intermediate_size
        shapes |= {"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
                   "mlp.down_proj.weight": (h, i)}
    else:
        e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes |= {"mlp.gate.weight": (e, h), "mlp.shared_expert.gate_proj.weight": (s, h),
                   "mlp.shared_expert.up_proj.weight": (s, h),
                   "mlp.shared_expert.down_proj.weight": (h, s),
                   "mlp.shared_expert_gate.weight": (1, h),
                   "mlp.experts.gate_up_proj": (e, 2 * i, h), "mlp.experts.down_proj": (e, h, i)}
    return {p + n: (s, "F32" if n.endswith(("A_log", "dt_bias")) else "BF16")
            for n, s in shapes.items()}


# Qwen3_5VisionConfig's defaults, for config.json files that leave a key out.
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "in_channels": 3,
                   "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                   "out_hidden_size": 3584, "num_position_embeddings": 2304}


def _vision_layout(config: dict[str, Any]) -> dict[str, tuple[Shape, str]]:
    v = VISION_DEFAULTS | config
    h, m = v["hidden_size"], v["intermediate_size"]
    merged = h * v["spatial_merge_size"] ** 2
    p = v["patch_size"]
    shapes: dict[str, Shape] = {
        "patch_embed.proj.weight": (h, v["in_channels"], v["temporal_patch_size"], p, p),
        "patch_embed.proj.bias": (h,),
        "pos_embed.weight": (v["num_position_embeddings"], h),
    }
    for j in range(v["depth"]):
        for n, s in (("norm1", (h,)), ("norm2", (h,))):
            shapes |= {f"blocks.{j}.{n}.weight": s, f"blocks.{j}.{n}.bias": s}
        for n, (o, i) in (("attn.qkv", (3 * h, h)), ("attn.proj", (h, h)),
                          ("mlp.linear_fc1", (m, h)), ("mlp.linear_fc2", (h, m))):
            shapes |= {f"blocks.{j}.{n}.weight": (o, i), f"blocks.{j}.{n}.bias": (o,)}
    for n, (o, i) in (("linear_fc1", (merged, merged)),
                      ("linear_fc2", (v["out_hidden_size"], merged))):
        shapes |= {f"merger.{n}.weight": (o, i), f"merger.{n}.bias": (o,)}
    shapes |= {"merger.norm.weight": (h,), "merger.norm.bias": (h,)}
    return {VISION + n: (s, "BF16") for n, s in shapes.items()}


Draw = Callable[[str, int, Shape, torch.Generator], torch.Tensor]


class RandomTensors:
    """Tensors of a layout (name -> (shape, dtype tag), e.g. `hf_layout(cfg)`) drawn on demand;
    tensor `name` depends only on (seed, name).

    `draw` gives the values; the default `_draw` follows the trained Qwen3.5 conventions closely
    enough that a random model runs with sane activations: N(0, 0.02) for linears and
    embeddings, small values around 0 for the (1 + w) RMSNorms, 1 for the GDN gated norm and
    LayerNorm scales, 0 for biases, A = exp(A_log) uniform in [1, 16] and
    dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (the Mamba-2 initialisation).

    Values are drawn on `device` and handed over on the CPU: a 27B model is ~27e9 draws, minutes
    for one CPU generator and a moment for a GPU's. CPU and CUDA generators differ, so a
    tensor depends on (seed, name, the device type that drew it).
    """

    CHUNK = 1 << 24  # elements drawn at once, bounding the fp32 temporaries

    def __init__(self, layout: dict[str, tuple[Shape, str]], seed: int, draw: Draw | None = None,
                 device: str = "cpu"):
        self.seed = seed
        self.device = device
        self._layout = layout
        self._draw = draw or _draw
        origin = f"random-init(seed={seed})"
        self.tensors = {
            name: SourceTensor(name, shape, tag, "plain",
                               math.prod(shape) * DTYPES[tag].itemsize, origin)
            for name, (shape, tag) in self._layout.items()
        }

    def load(self, name: str) -> dict[str, torch.Tensor]:
        shape, tag = self._layout[name]
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        gen = torch.Generator(self.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        out = torch.empty(shape, dtype=DTYPES[tag], device=self.device)
        flat = out.view(-1)
        for start in range(0, flat.numel(), self.CHUNK):
            n = min(self.CHUNK, flat.numel() - start)
            flat[start:start + n] = self._draw(name, n, shape, gen)
        return {"weight": out.cpu()}


def _draw(name: str, n: int, shape: Shape, gen: torch.Generator) -> torch.Tensor:
    """`n` fp32 values of tensor `name` on gen's device (see RandomTensors for the rules)."""
    device = gen.device
    if name.endswith("A_log"):
        return torch.empty(n, device=device).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith("dt_bias"):
        dt = torch.empty(n, device=device).uniform_(math.log(1e-3), math.log(1e-1),
                                                    generator=gen).exp_()
        return dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
    if name.endswith(".bias"):
        return torch.zeros(n, device=device)
    if name.endswith("linear_attn.norm.weight") or (name.startswith(VISION) and "norm" in name):
        return torch.ones(n, device=device)
    if name.endswith("conv1d.weight"):
        bound = shape[-1] ** -0.5
        return torch.empty(n, device=device).uniform_(-bound, bound, generator=gen)
    std = 0.02 if len(shape) > 1 else 0.01  # 1-D here: the (1 + w) RMSNorm weights
    return torch.randn(n, generator=gen, device=device) * std
