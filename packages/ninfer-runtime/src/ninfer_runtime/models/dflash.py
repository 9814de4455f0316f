"""The DFlash draft model (z-lab's `DFlashDraftModel`, arXiv 2602.06036) over NInfer weights.

A stack of Qwen3-style decoder layers (plain x * w RMSNorms, q/k norm, full-head NeoX RoPE,
SwiGLU MLP) without embedding or lm_head: it borrows the target's. It drafts a block of
`block_size` tokens [anchor, MASK, ..., MASK] in one pass, conditioned on the target through
"KV injection":

    c_t = hidden_norm(fc(cat(target hidden after layer i, i in target_layer_ids)))
    every draft layer stores k_norm(k_proj(c_t)) (RoPE at t) and v_proj(c_t) for each
    committed position t: `store_context`, into the layer's own paged K/V
    the block's queries attend to that context and to the block's own K/V: `propose`

Full-attention layers are non-causal (the whole block sees itself); sliding layers are causal
with a window of `sliding_window` keys (vLLM / SGLang semantics) unless the config says
otherwise (`is_causal`, `dflash_config.causal`). The artifact stores the weights under
`dflash.` (ninfer_convert.dflash) and this config under the manifest's "dflash" entry.
`output_multiplier` / `final_logit_softcapping` of newer configs are monotone and leave the
drafts' argmax alone, so they are not read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from ninfer_runtime.config import FULL_ATTENTION, ModelConfig, rope_scaling
from ninfer_runtime.engine.batch import StepBatch
from ninfer_runtime.models.cache import PagedKV
from ninfer_runtime.models.layers import mlp
from ninfer_runtime.models.weights import MLPWeights, WeightReader
from ninfer_runtime.ops.attention import paged_attention
from ninfer_runtime.ops.linear import Weight, linear
from ninfer_runtime.ops.norm import add_rms_norm, rms_norm
from ninfer_runtime.ops.rope import qk_norm_rope_store, rope_cos_sin

if TYPE_CHECKING:
    from ninfer_runtime.artifact import Artifact

SLIDING_ATTENTION = "sliding_attention"
DRAFT_ARCHITECTURE = "DFlashDraftModel"
PREFIX = "dflash."


class DFlashConfigError(ValueError):
    """A DFlash draft config that NInfer cannot run, or that does not fit its target."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default taps: round(1 + i * (N - 4) / (L - 1)), the middle layer for L = 1
    (64 target layers, 5 draft layers: 1, 16, 31, 46, 61)."""
    if num_target_layers < 4:
        raise DFlashConfigError(f"DFlash taps need a target of at least 4 layers, not "
                                f"{num_target_layers}")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1)))
                 for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # Hugging Face rope parameters beyond the default
    layer_types: tuple[str, ...]  # "full_attention" or "sliding_attention" per layer
    sliding_window: int | None  # keys a sliding layer's query sees, itself included
    causal: tuple[bool, ...]  # per layer
    block_size: int  # anchor + drafted tokens per pass
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target layers whose outputs are tapped (0-based)
    num_target_layers: int | None = None  # as the draft declares it, when it does
    vocab_size: int | None = None
    input_embedding_scale: float = 1.0

    @property
    def tap_width(self) -> int:
        """Width of the concatenated taps fc reads: len(target_layer_ids) * hidden_size."""
        return len(self.target_layer_ids) * self.hidden_size

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> DFlashConfig:
        """Reads a z-lab draft config.json. block_size, mask_token_id and target_layer_ids
        may sit at the top level or in `dflash_config` (which wins, as in z-lab's code)."""
        arch = hf.get("architectures") or [DRAFT_ARCHITECTURE]
        if DRAFT_ARCHITECTURE not in arch:
            raise DFlashConfigError(f"architectures {arch} is not {DRAFT_ARCHITECTURE} (DFlash "
                                    "2 and other drafters are different formats)")
        nested = hf.get("dflash_config") or {}

        def get(name: str, default: Any = None, *, top: bool = True) -> Any:
            return nested.get(name, hf.get(name, default) if top else default)

        def need(name: str) -> Any:
            value = get(name)
            if value is None:
                raise DFlashConfigError(f"config lacks {name!r} (top level or dflash_config)")
            return value

        try:
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            hidden = int(hf["hidden_size"])
            theta, scaling = _rope(hf)
            layer_types = tuple(hf.get("layer_types") or [FULL_ATTENTION] * layers)
            forced = get("causal", top=False)
            forced = hf.get("is_causal") if forced is None else forced
            config = cls(
                hidden_size=hidden,
                num_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                intermediate_size=int(hf["intermediate_size"]),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                layer_types=layer_types,
                sliding_window=(int(hf["sliding_window"]) if SLIDING_ATTENTION in layer_types
                                else None),
                causal=tuple(kind == SLIDING_ATTENTION if forced is None else bool(forced)
                             for kind in layer_types),
                block_size=int(get("block_size", 16)),
                mask_token_id=int(need("mask_token_id")),
                target_layer_ids=tuple(int(i) for i in need("target_layer_ids")),
                num_target_layers=_optional_int(get("num_target_layers")),
                vocab_size=_optional_int(hf.get("vocab_size")),
                input_embedding_scale=float(get("input_embedding_scale", 1.0)),
            )
        except KeyError as e:
            raise DFlashConfigError(f"config lacks {e.args[0]!r}") from None
        except DFlashConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise DFlashConfigError(f"config has a malformed field ({e})") from None
        config._check()
        return config

    def _check(self) -> None:
        if len(self.layer_types) != self.num_layers or \
                set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
            raise DFlashConfigError(f"layer_types {list(self.layer_types)} does not describe "
                                    f"{self.num_layers} full/sliding attention layers")
        sizes = {"hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
                 "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                 "num_key_value_heads": self.num_key_value_heads,
                 "sliding_window": self.sliding_window or 1}
        bad = [k for k, v in sizes.items() if v < 1]
        if bad:
            raise DFlashConfigError(f"{bad[0]} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashConfigError(f"{self.num_attention_heads} attention heads do not group "
                                    f"over {self.num_key_value_heads} kv heads")
        if self.block_size < 2:
            raise DFlashConfigError(f"block_size {self.block_size} drafts nothing (it counts "
                                    "the anchor)")
        if not self.target_layer_ids:
            raise DFlashConfigError("target_layer_ids is empty")
        if self.head_dim % 2:
            raise DFlashConfigError(f"head_dim {self.head_dim} is odd (RoPE pairs dims)")

    def check_target(self, target: ModelConfig) -> None:
        """Raises DFlashConfigError when the draft cannot run on `target`."""
        if self.hidden_size != target.hidden_size:
            raise DFlashConfigError(f"hidden_size {self.hidden_size} differs from the "
                                    f"target's {target.hidden_size}")
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            raise DFlashConfigError(f"vocab_size {self.vocab_size} differs from the target's "
                                    f"{target.vocab_size}")
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            raise DFlashConfigError(f"num_target_layers {self.num_target_layers} differs from "
                                    f"the target's {target.num_layers} layers")
        outside = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if outside:
            raise DFlashConfigError(f"target_layer_ids {list(self.target_layer_ids)}: "
                                    f"{outside[0]} is not a layer of the target (0.."
                                    f"{target.num_layers - 1})")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise DFlashConfigError(f"mask_token_id {self.mask_token_id} is outside the "
                                    f"target's vocabulary of {target.vocab_size}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON for the manifest (`from_dict` reads it back)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DFlashConfig:
        try:
            config = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
        except TypeError as e:
            raise DFlashConfigError(f"manifest 'dflash' config is malformed ({e})") from None
        config._check()
        return config

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> DFlashConfig | None:
        """The draft's config from an artifact manifest; None when it packs no draft."""
        entry = manifest.get("dflash")
        return None if entry is None else cls.from_dict(entry["config"])


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_scaling` +
    `rope_theta`; scaling is None for plain RoPE and carries every parameter it needs."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    try:
        return theta, rope_scaling(params, hf.get("original_max_position_embeddings",
                                                  hf.get("max_position_embeddings")))
    except ValueError as e:
        raise DFlashConfigError(str(e)) from None


@dataclass(frozen=True)
class DFlashLayerWeights:
    input_layernorm: torch.Tensor  # [H], plain x * w
    post_attention_layernorm: torch.Tensor
    q_proj: Weight  # [nq * hd, H]
    kv_proj: Weight  # [2 * nkv * hd, H]: k rows, then v rows
    o_proj: Weight  # [H, nq * hd]
    q_norm: torch.Tensor  # [hd], plain
    k_norm: torch.Tensor
    mlp: MLPWeights

    @classmethod
    def load(cls, r: WeightReader, p: str, cfg: DFlashConfig) -> DFlashLayerWeights:
        h, hd = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        return cls(
            input_layernorm=r.norm(p + "input_layernorm.weight", h),
            post_attention_layernorm=r.norm(p + "post_attention_layernorm.weight", h),
            q_proj=r.linear(p + "self_attn.q_proj.weight", q, h),
            kv_proj=r.linear(p + "self_attn.kv_proj.weight", 2 * kv, h),
            o_proj=r.linear(p + "self_attn.o_proj.weight", h, q),
            q_norm=r.norm(p + "self_attn.q_norm.weight", hd),
            k_norm=r.norm(p + "self_attn.k_norm.weight", hd),
            mlp=MLPWeights.load(r, p + "mlp.", h, cfg.intermediate_size),
        )


class DFlashDraft:
    """Reads only `dflash.*` from `weights`; compute in `dtype` (norms and softmax in fp32)."""

    def __init__(self, config: DFlashConfig, weights: Mapping[str, Weight], *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        r = WeightReader(weights, dtype, device)
        h = config.hidden_size
        self.fc: Weight = r.linear(PREFIX + "fc.weight", h, config.tap_width)
        self.hidden_norm = r.norm(PREFIX + "hidden_norm.weight", h)
        self.layers = [DFlashLayerWeights.load(r, f"{PREFIX}layers.{i}.", config)
                       for i in range(config.num_layers)]
        self.norm = r.norm(PREFIX + "norm.weight", h)

    @classmethod
    def from_weights(cls, manifest: Mapping[str, Any], weights: Mapping[str, Weight], *,
                     dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> DFlashDraft | None:
        """The draft an artifact packs (its manifest and weights), or None when it has none."""
        config = DFlashConfig.from_manifest(manifest)
        return None if config is None else cls(config, weights, dtype=dtype, device=device)

    def allocate_cache(self, num_pages: int, page_size: int,
                       device: torch.device | str | None = None) -> list[PagedKV]:
        """One paged K/V cache per draft layer, [num_pages, page_size, nkv, head_dim] in the
        compute dtype. It holds the context's K/V (and a proposed block's, until context
        overwrites them), addressed by the StepBatch's slots like the target's."""
        shape = (num_pages, page_size, self.config.num_key_value_heads, self.config.head_dim)
        device = self.device if device is None else device
        return [PagedKV(torch.zeros(shape, dtype=self.dtype, device=device),
                        torch.zeros(shape, dtype=self.dtype, device=device))
                for _ in self.layers]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return rope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling)

    def _check_caches(self, caches: Sequence[PagedKV]) -> None:
        if len(caches) != len(self.layers):
            raise ValueError(f"{len(caches)} caches for {len(self.layers)} draft layers")

    def store_context(self, taps: torch.Tensor, batch: StepBatch,
                      caches: Sequence[PagedKV]) -> None:
        """Injects committed positions: taps [N, L_tap * H] (the target's hidden after each
        tapped layer, in target_layer_ids order, for the batch's N tokens) become every
        layer's K/V at batch.positions, stored at batch.slot_mapping."""
        self._check_caches(caches)
        c = self.config
        n, nkv, hd = taps.shape[0], c.num_key_value_heads, c.head_dim
        ctx = linear(taps.to(self.dtype), self.fc)
        ctx = rms_norm(ctx, self.hidden_norm, c.rms_norm_eps, unit_offset=False)
        cos, sin = self._rope(batch.positions)
        for w, kv in zip(self.layers, caches, strict=True):
            k, v = linear(ctx, w.kv_proj).split([nkv * hd, nkv * hd], dim=-1)
            qk_norm_rope_store(None, k.reshape(n, nkv, hd), v.reshape(n, nkv, hd), None,
                               w.k_norm, cos, sin, c.rms_norm_eps,
                               kv.store(batch.slot_mapping), unit_offset=False)

    def propose(self, block_ids: torch.Tensor, batch: StepBatch, caches: Sequence[PagedKV],
                embed_tokens: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [B * T, H] of the blocks block_ids [B * T]: per request
        one segment [anchor, MASK * (T - 1)] at positions P .. P + T - 1, P its committed
        context (the anchor is the sampled token the target has not run yet). Row j >= 1 of a
        block gives draft j, the token at position P + j (through the target's lm_head or a
        DraftHead); row 0 is no draft. T may be below block_size. The blocks' own K/V are
        stored at their slots, where later context overwrites them."""
        self._check_caches(caches)
        c = self.config
        eps = c.rms_norm_eps
        x = embed_tokens[block_ids].to(self.dtype)
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        rope = self._rope(batch.positions)
        h = None
        for i, (w, kv) in enumerate(zip(self.layers, caches, strict=True)):
            if h is None:
                normed = rms_norm(x, w.input_layernorm, eps, unit_offset=False)
            else:
                x, normed = add_rms_norm(x, h, w.input_layernorm, eps, unit_offset=False)
            h = self._attention(normed, w, kv, batch, rope, i)
            x, normed = add_rms_norm(x, h, w.post_attention_layernorm, eps, unit_offset=False)
            h = mlp(normed, w.mlp)
        return add_rms_norm(x, h, self.norm, eps, unit_offset=False)[1]

    def _attention(self, x: torch.Tensor, w: DFlashLayerWeights, kv: PagedKV, batch: StepBatch,
                   rope: tuple[torch.Tensor, torch.Tensor], layer: int) -> torch.Tensor:
        c = self.config
        n, nq, nkv, hd = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = linear(x, w.q_proj).reshape(n, nq, hd)
        k, v = linear(x, w.kv_proj).split([nkv * hd, nkv * hd], dim=-1)
        q = qk_norm_rope_store(q, k.reshape(n, nkv, hd), v.reshape(n, nkv, hd), w.q_norm,
                               w.k_norm, *rope, c.rms_norm_eps, kv.store(batch.slot_mapping),
                               unit_offset=False)
        out = paged_attention(q, kv.k, kv.v, None, None, batch.page_tables, batch.cu_seqlens,
                              batch.context_lens, hd**-0.5, causal=c.causal[layer],
                              window=c.window(layer))
        return linear(out.reshape(n, nq * hd), w.o_proj)


def load_dflash(artifact: Artifact, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> DFlashDraft | None:
    """The DFlash draft packed in an opened artifact, checked against its target; None when
    the artifact has none."""
    config = DFlashConfig.from_manifest(artifact.manifest)
    if config is None:
        return None
    config.check_target(artifact.config)
    return DFlashDraft(config, artifact.weights(), dtype=dtype, device=device)
