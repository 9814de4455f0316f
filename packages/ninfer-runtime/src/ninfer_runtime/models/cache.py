"""Decoding state storage: paged K/V for full-attention layers, state slots for GDN layers.

One layer's cache is a plain record of tensors shared by every sequence: `PagedKV` holds pages of
K/V (a sequence owns some pages, listed in its page table), `GDNSlots` holds conv windows and
recurrent states (a sequence owns one slot). Which pages and slot a sequence uses travels in the
`StepBatch`. The engine allocates one big cache for all its requests and accounts pages and
slots itself (engine.kv_pool, engine.state_pool); `SequenceCache` is the same storage for one
sequence, grown on demand, for the offline API and the tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ninfer_runtime.config import FULL_ATTENTION, ModelConfig
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.ops.attention import KVStore
from ninfer_runtime.ops.kv_quant import SCALE_DTYPE, kv_group_size

DEFAULT_PAGE_SIZE = 64


@dataclass(frozen=True)
class PagedKV:
    """K and V pages [num_pages, page_size, nkv, head_dim]: in the compute dtype, or int8 with
    fp16 scales [num_pages, page_size, nkv, head_dim // group] (ops.kv_quant)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_pages: int, page_size: int, *, int8: bool,
                 dtype: torch.dtype, device: torch.device | str) -> PagedKV:
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        if not int8:
            return cls(torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device))
        scales = (*shape[:-1], cfg.head_dim // kv_group_size(cfg.head_dim))
        return cls(torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.zeros(scales, dtype=SCALE_DTYPE, device=device),
                   torch.zeros(scales, dtype=SCALE_DTYPE, device=device))

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    def store(self, slot_mapping: torch.Tensor) -> KVStore:
        """Where a step's K/V rows go: these pages, at the tokens' flat slots."""
        return KVStore(self.k, self.v, self.k_scale, self.v_scale, slot_mapping)

    def grown(self, num_pages: int) -> PagedKV:
        """A copy with `num_pages` pages, the existing ones first."""

        def grow(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = t.new_zeros((num_pages, *t.shape[1:]))
            out[: t.shape[0]] = t
            return out

        return replace(self, k=grow(self.k), v=grow(self.v), k_scale=grow(self.k_scale),
                       v_scale=grow(self.v_scale))


@dataclass(frozen=True)
class GDNSlots:
    """conv [num_slots, conv_dim, K-1] (the last K-1 pre-conv inputs, compute dtype) and
    recurrent [num_slots, nv, dk, dv] (fp32). A fresh sequence starts from a zeroed slot."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_slots: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> GDNSlots:
        conv = (num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
        rec = (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
               cfg.linear_value_head_dim)
        return cls(torch.zeros(conv, dtype=dtype, device=device),
                   torch.zeros(rec, dtype=torch.float32, device=device))

    def reset(self, slot: int) -> None:
        self.conv[slot] = 0
        self.recurrent[slot] = 0

    def copy(self, src: int, dst: int) -> None:
        self.conv[dst] = self.conv[src]
        self.recurrent[dst] = self.recurrent[src]


LayerCache = PagedKV | GDNSlots


def allocate_layer_caches(cfg: ModelConfig, layer_types: Sequence[str], *, num_pages: int,
                          page_size: int, num_slots: int, int8_kv: bool, dtype: torch.dtype,
                          device: torch.device | str) -> list[LayerCache]:
    """One cache per layer, in layer order."""
    return [PagedKV.allocate(cfg, num_pages, page_size, int8=int8_kv, dtype=dtype, device=device)
            if kind == FULL_ATTENTION else
            GDNSlots.allocate(cfg, num_slots, dtype=dtype, device=device)
            for kind in layer_types]


class SequenceCache:
    """One sequence's state, as a batch of one over the engine's storage types: pages 0.. in
    order (grown by doubling when the sequence outgrows them), GDN slot 0, unquantized K/V."""

    def __init__(self, layers: list[LayerCache], page_size: int, device: torch.device):
        self.layers = layers
        self.page_size = page_size
        self.device = device
        self.num_tokens = 0  # tokens already through the model: the next token's position

    @classmethod
    def empty(cls, cfg: ModelConfig, layer_types: Sequence[str], dtype: torch.dtype,
              device: torch.device | str, page_size: int = DEFAULT_PAGE_SIZE) -> SequenceCache:
        layers = allocate_layer_caches(cfg, layer_types, num_pages=1, page_size=page_size,
                                       num_slots=1, int8_kv=False, dtype=dtype, device=device)
        return cls(layers, page_size, torch.device(device))

    @property
    def num_pages(self) -> int:
        return next((c.num_pages for c in self.layers if isinstance(c, PagedKV)), 0)

    def step(self, token_ids: Sequence[int], start_pos: int) -> StepBatch:
        """The StepBatch that appends `token_ids` at start_pos (logits wanted for every row),
        after growing the pages to fit. Call `advance` once the forward ran."""
        if start_pos != self.num_tokens:
            raise ValueError(f"start_pos {start_pos} does not continue the cache, which holds "
                             f"{self.num_tokens} tokens (GDN state cannot be rewound)")
        needed = -(-(start_pos + len(token_ids)) // self.page_size)
        if needed > self.num_pages:
            pages = max(needed, 2 * self.num_pages)
            self.layers = [c.grown(pages) if isinstance(c, PagedKV) else c for c in self.layers]
        segment = Segment(token_ids, start_pos, range(needed), 0, "all")
        return StepBatch.build([segment], self.page_size, self.device)

    def advance(self, num_tokens: int) -> None:
        self.num_tokens += num_tokens
