"""The multi-token-prediction (MTP) head of Qwen3.5: one extra full-attention decoder layer.

For the token x_{t+1} that follows position t and the target's final-normed hidden state h_t:

    u = fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])   # [emb, hidden]
    u = decoder_layer(u)          # full attention with its own KV cache, at position t
    h = mtp.norm(u);  logits = lm_head(h)

embed_tokens and lm_head are the target's. For more than one draft token the layer is applied
again with h as the next h_t. There is no transformers oracle (transformers drops mtp.*); this
follows the vLLM / SGLang Qwen3.5 MTP modules.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ninfer_runtime.config import FULL_ATTENTION, ModelConfig
from ninfer_runtime.engine.batch import StepBatch
from ninfer_runtime.models.cache import PagedKV, SequenceCache
from ninfer_runtime.models.layers import run_layers
from ninfer_runtime.models.weights import DecoderLayerWeights, WeightReader
from ninfer_runtime.ops.linear import Weight, linear
from ninfer_runtime.ops.norm import rms_norm


class Qwen3_5MTP:
    """Reads only mtp.*, embed_tokens.weight and lm_head.weight from `weights`.

    Pass the target model's converted `embed_tokens` / `lm_head` under those names to share
    them: tensors already in the right dtype and device are not copied.
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight], *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if config.mtp_num_hidden_layers != 1:
            raise ValueError(f"NInfer runs exactly one MTP layer; the config has "
                             f"mtp_num_hidden_layers={config.mtp_num_hidden_layers}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        r = WeightReader(weights, dtype, device)
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens: torch.Tensor = r.take("embed_tokens.weight", (vocab, hidden))
        self.lm_head: Weight = r.linear("lm_head.weight", vocab, hidden)
        self.fc: Weight = r.linear("mtp.fc.weight", hidden, 2 * hidden)
        self.pre_fc_norm_embedding = r.norm("mtp.pre_fc_norm_embedding.weight", hidden)
        self.pre_fc_norm_hidden = r.norm("mtp.pre_fc_norm_hidden.weight", hidden)
        self.layer = DecoderLayerWeights.load(r, "mtp.layers.0.", config, full_attention=True)
        self.norm = r.norm("mtp.norm.weight", hidden)

    def new_cache(self) -> SequenceCache:
        """An empty MTP cache (the MTP layer's own K/V) for one new sequence."""
        return SequenceCache.empty(self.config, (FULL_ATTENTION,), self.dtype, self.device)

    def allocate_cache(self, num_pages: int, page_size: int, int8_kv: bool) -> PagedKV:
        """The MTP layer's K/V for many sequences: `num_pages` pages (a sequence uses the
        page ids of its target page table, in this separate storage)."""
        return PagedKV.allocate(self.config, num_pages, page_size, int8=int8_kv,
                                dtype=self.dtype, device=self.device)

    def forward_batch(self, batch: StepBatch, hidden_prev: torch.Tensor,
                      kv: PagedKV) -> torch.Tensor:
        """The MTP's hidden [N, H] (post mtp.norm: the h_prev of the next draft step) for a
        step whose token_ids are the next tokens x_{t+1} of positions t = batch.positions,
        paired with hidden_prev [N, H] (the target's final-normed hidden at t, or the MTP's
        own output one position earlier); stores the layer's K/V at t in `kv`."""
        eps = self.config.rms_norm_eps
        e = rms_norm(self.embed_tokens[batch.token_ids], self.pre_fc_norm_embedding, eps)
        h = rms_norm(hidden_prev.to(self.device, self.dtype), self.pre_fc_norm_hidden, eps)
        u = linear(torch.cat([e, h], dim=-1), self.fc)
        return run_layers(u, [self.layer], [kv], batch, self.config, self.norm)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared lm_head over hidden [..., H] -> fp32 logits [..., vocab]."""
        return linear(hidden, self.lm_head).float()

    def forward(self, next_token_ids: torch.Tensor, hidden_prev: torch.Tensor, start_pos: int,
                cache: SequenceCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: next_token_ids [T] (token t+1 for each position t), hidden_prev [T, H]
        (the target's final-normed hidden at t), positions start_pos.. -> (hidden [T, H], fp32
        logits [T, vocab]). The returned hidden is the h_prev of the next draft step."""
        batch = cache.step(next_token_ids.tolist(), start_pos)
        kv = cache.layers[0]
        assert isinstance(kv, PagedKV)
        hidden = self.forward_batch(batch, hidden_prev, kv)
        cache.advance(len(next_token_ids))
        return hidden, self.logits(hidden)
