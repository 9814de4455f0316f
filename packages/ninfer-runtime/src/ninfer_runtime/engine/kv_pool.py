"""The paged KV pool: the full-attention layers' K/V storage and its page accounting.

Storage is one `PagedKV` per full-attention layer (models.cache), all with the same number of
pages; page i of a request means page i in every layer. K/V are stored INT8 with one fp16
scale per 64 elements (kv_dtype "int8", ops.kv_quant) or unquantized in the model's compute
dtype (kv_dtype "bf16": bf16 on the GPU; the fp32 CPU reference keeps fp32 so that it stays
exact).

The allocator hands out page ids with a reference count, so a page can later be shared by
several requests (prefix reuse) and returns to the free list when its last holder releases it.
The scheduler reserves at admission every page a request can ever need (prompt + max_tokens):
a running request never waits for memory and nothing is ever preempted; the price is that pages
a request does not reach (it stops early) sit idle until it finishes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ninfer_runtime.config import FULL_ATTENTION, ModelConfig
from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.models.cache import PagedKV
from ninfer_runtime.ops.kv_quant import SCALE_DTYPE, kv_group_size

CUDA_KV_MEMORY_FRACTION = 0.5  # share of the free GPU memory "auto" gives the KV pool


class OutOfPagesError(RuntimeError):
    """More pages asked for than are free (the scheduler checks first, so this is a bug)."""


class PageAllocator:
    """Page ids 0 .. num_pages-1 with reference counts. Pure Python, no tensors."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each with one reference."""
        if n > len(self._free):
            raise OutOfPagesError(f"{n} pages asked for, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more reference to each of `pages` (already allocated)."""
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} is free and cannot be shared")
            self._refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each of `pages`; a page with none left is free again."""
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} is already free")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def request_pages(config: EngineConfig) -> int:
    """Pages one request of max_context tokens reserves (the scheduler's reservation: the K
    draft positions a verify step writes beyond the sequence included)."""
    return pages_for(config.max_context + config.spec_tokens, config.page_size)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, dtype: torch.dtype) -> int:
    """K + V bytes one token takes over all full-attention layers (scales included)."""
    per_head = cfg.head_dim * dtype.itemsize
    if kv_dtype == "int8":
        per_head = cfg.head_dim + cfg.head_dim // kv_group_size(cfg.head_dim) * SCALE_DTYPE.itemsize
    return 2 * cfg.layer_types.count(FULL_ATTENTION) * cfg.num_key_value_heads * per_head


def resolve_kv_capacity(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype,
                        device: torch.device) -> int:
    """KV pool size in tokens, a whole number of pages.

    "auto" is room for max_concurrency requests of max_context tokens (whole pages each, the
    draft positions of speculative decoding included) on the CPU; on CUDA it is that, capped
    by CUDA_KV_MEMORY_FRACTION of the free memory (a first estimate: the GPU memory plan
    replaces it). An explicit capacity is rounded up to whole pages.
    """
    wanted = config.max_concurrency * request_pages(config) * config.page_size
    if config.kv_capacity != "auto":
        wanted = int(config.kv_capacity)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        fits = int(free * CUDA_KV_MEMORY_FRACTION) // kv_bytes_per_token(cfg, config.kv_dtype,
                                                                           dtype)
        wanted = min(wanted, fits // config.page_size * config.page_size)
        if wanted < config.page_size:
            raise MemoryError(f"{free / 2**30:.1f} GiB free on {device}: not one KV page fits")
    return pages_for(wanted, config.page_size) * config.page_size


class KVPool:
    """The attention layers' `PagedKV` storage (same page count in each) and its allocator."""

    def __init__(self, layers: Sequence[PagedKV]):
        if not layers or len({kv.k.shape[:2] for kv in layers}) != 1:
            raise ValueError("a KV pool needs attention layers with equal page counts and sizes")
        self.layers = tuple(layers)
        self.page_size = layers[0].k.shape[1]
        self.allocator = PageAllocator(layers[0].num_pages)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def capacity(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_pages * self.page_size

    def pages_for(self, tokens: int) -> int:
        return pages_for(tokens, self.page_size)

    def can_reserve(self, tokens: int) -> bool:
        return self.pages_for(tokens) <= self.allocator.num_free

    def reserve(self, tokens: int) -> list[int]:
        """Fresh pages for `tokens` tokens (a request's page table)."""
        return self.allocator.allocate(self.pages_for(tokens))

    def release(self, pages: Sequence[int]) -> None:
        self.allocator.release(pages)
