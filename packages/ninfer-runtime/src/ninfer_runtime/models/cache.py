"""Per-sequence decoding state: K/V for full-attention layers, conv + recurrent state for GDN.

One `SequenceCache` holds one sequence's state for every layer, in layer order. It is a plain
mutable record the layers update as tokens go through; a paged KV pool and a GDN state pool
replace it when the engine batches sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer_runtime.config import FULL_ATTENTION, ModelConfig


@dataclass
class KVState:
    """Keys (after k_norm and RoPE) and values of every token so far: [S, nkv, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = torch.cat([self.k, k], dim=0)
        self.v = torch.cat([self.v, v], dim=0)


@dataclass
class GDNState:
    """conv: the last K-1 pre-conv inputs [conv_dim, K-1]; recurrent: fp32 [nv, dk, dv]."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class SequenceCache:
    layers: list[KVState | GDNState]
    num_tokens: int = 0  # tokens already through the model: the next token's position

    @classmethod
    def empty(cls, cfg: ModelConfig, layer_types: Sequence[str], dtype: torch.dtype,
              device: torch.device | str) -> SequenceCache:
        """Zero state for a fresh sequence through layers of the given types."""
        layers: list[KVState | GDNState] = []
        for kind in layer_types:
            if kind == FULL_ATTENTION:
                kv = (0, cfg.num_key_value_heads, cfg.head_dim)
                layers.append(KVState(torch.empty(kv, dtype=dtype, device=device),
                                      torch.empty(kv, dtype=dtype, device=device)))
            else:
                conv = (cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
                rec = (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim)
                layers.append(GDNState(torch.zeros(conv, dtype=dtype, device=device),
                                       torch.zeros(rec, dtype=torch.float32, device=device)))
        return cls(layers)
