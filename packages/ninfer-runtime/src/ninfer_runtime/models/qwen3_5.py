"""The Qwen3.5 / 3.6 / 3.8 text model (dense and MoE) over NInfer-named weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ninfer_runtime.config import FULL_ATTENTION, ModelConfig
from ninfer_runtime.engine.batch import StepBatch
from ninfer_runtime.models.cache import LayerCache, SequenceCache, allocate_layer_caches
from ninfer_runtime.models.layers import run_layers
from ninfer_runtime.models.weights import DecoderLayerWeights, WeightReader
from ninfer_runtime.ops.linear import Weight, linear


class Qwen3_5Model:
    """embed -> decoder layers (3 GDN : 1 gated attention) -> final norm -> lm_head.

    `weights` maps NInfer names (ninfer_convert.mapping) to tensors or PackedWeights; only the
    text-model tensors are read (not mtp.*, not visual.*). Compute runs in `dtype` (fp32 for
    the CPU oracle tests, bf16 on GPU); norms, softmax, gating and the GDN state stay fp32.
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight], *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        r = WeightReader(weights, dtype, device)
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens: torch.Tensor = r.take("embed_tokens.weight", (vocab, hidden))
        self.layers = [
            DecoderLayerWeights.load(r, f"layers.{i}.", config, kind == FULL_ATTENTION)
            for i, kind in enumerate(config.layer_types)
        ]
        self.norm = r.norm("norm.weight", hidden)
        self.lm_head: Weight = r.linear("lm_head.weight", vocab, hidden)

    def allocate_cache(self, num_pages: int, page_size: int, num_slots: int,
                       int8_kv: bool) -> list[LayerCache]:
        """Storage for many sequences: `num_pages` KV pages per attention layer (int8 or the
        compute dtype), `num_slots` GDN state slots per GDN layer."""
        return allocate_layer_caches(self.config, self.config.layer_types, num_pages=num_pages,
                                     page_size=page_size, num_slots=num_slots, int8_kv=int8_kv,
                                     dtype=self.dtype, device=self.device)

    def new_cache(self) -> SequenceCache:
        """An empty cache for one new sequence."""
        return SequenceCache.empty(self.config, self.config.layer_types, self.dtype, self.device)

    def forward_batch(self, batch: StepBatch, caches: Sequence[LayerCache]) -> torch.Tensor:
        """Final-normed hidden states [N, H] of the step's tokens, advancing each sequence's
        pages and state slot in `caches`."""
        return self.forward_taps(batch, caches, ())[0]

    def forward_taps(self, batch: StepBatch, caches: Sequence[LayerCache],
                     taps: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_batch`, also returning the residual stream after each decoder layer in
        `taps` (0-based ids; HF hidden_states[i + 1]), concatenated [N, len(taps) * H] in that
        order: the context features a DFlash draft reads."""
        x = self.embed_tokens[batch.token_ids]
        return run_layers(x, self.layers, caches, batch, self.config, self.norm, taps)

    def forward(self, input_ids: torch.Tensor, start_pos: int,
                cache: SequenceCache) -> torch.Tensor:
        """One sequence: hidden states [T, H] of input_ids [T] at positions start_pos..,
        continuing (and advancing) `cache`. Several tokens take the prompt path, one token the
        decode path; a prompt may be split over several calls."""
        batch = cache.step(input_ids.tolist(), start_pos)
        hidden = self.forward_batch(batch, cache.layers)
        cache.advance(len(input_ids))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over hidden [..., H] -> fp32 logits [..., vocab]."""
        return linear(hidden, self.lm_head).float()
