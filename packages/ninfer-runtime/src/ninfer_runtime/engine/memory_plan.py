"""The startup memory plan: where every byte of the device goes, decided before serving.

On a GPU the engine measures what it cannot compute (the weights already loaded, the peak
activations of the largest prefill step and of a full decode step, run once on a scratch
cache) and derives the KV pool from what is left after a safety margin. Nothing is discovered
later by an out-of-memory error: a request that can never fit is refused at admission, and an
explicit `--kv-capacity` that does not fit fails at startup with the plan in the message.

    total = weights + GDN state slots + prefill workspace + CUDA graph pool + KV pages
            + free margin + (memory other processes hold)

The CPU has no such budget: "auto" there is max_concurrency * max_context, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GiB = 2**30
MARGIN_FRACTION = 0.03  # of the device: allocator fragmentation, cuBLAS/Triton workspaces
MIN_MARGIN = 1 * GiB
GRAPH_POOL_FACTOR = 2  # the graphs share one pool sized by the largest step, plus slack


class MemoryPlanError(MemoryError):
    """The configuration cannot fit on the device; the message carries the plan."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per use on one device, and what they buy."""

    device: str
    total: int  # device memory
    other: int  # held by other processes / the CUDA context when the engine started
    weights: int
    state_slots: int  # GDN conv + recurrent state of every slot
    prefill_workspace: int  # peak activations of the largest step
    step_tokens: int  # the largest step's tokens
    graph_pool: int  # activations of the captured steps
    margin: int
    kv: int  # the KV pool
    kv_bytes_per_token: int
    kv_capacity: int  # tokens
    page_size: int
    max_context: int
    request_pages: int  # pages one request of max_context tokens reserves

    @property
    def free(self) -> int:
        """Bytes left beyond everything planned, margin excluded."""
        return self.total - self.other - self.weights - self.state_slots \
            - self.prefill_workspace - self.graph_pool - self.margin - self.kv

    @property
    def max_full_context_requests(self) -> int:
        """How many requests of max_context tokens the KV pool holds at once."""
        return self.kv_capacity // self.page_size // self.request_pages

    def rows(self) -> list[tuple[str, int, str]]:
        return [
            ("weights", self.weights, ""),
            ("GDN state slots", self.state_slots, ""),
            ("KV pages", self.kv, f"{self.kv_capacity:,} tokens "
                                  f"({self.kv_capacity // self.page_size:,} pages of "
                                  f"{self.page_size}, {self.kv_bytes_per_token:,} B/token)"),
            ("CUDA graph pool", self.graph_pool, ""),
            ("prefill workspace", self.prefill_workspace, f"{self.step_tokens:,} tokens a step"),
            ("free margin", self.margin, ""),
            ("other processes / context", self.other, ""),
            ("unplanned", max(0, self.free), ""),
        ]

    def table(self) -> str:
        """The plan as a fixed-width table (logged at startup, quoted in errors)."""
        lines = [f"memory plan on {self.device} ({self.total / GiB:.1f} GiB):"]
        for name, size, note in self.rows():
            lines.append(f"  {name:<27} {size / GiB:>8.2f} GiB  {note}".rstrip())
        lines.append(f"  -> KV capacity {self.kv_capacity:,} tokens: "
                     f"{self.max_full_context_requests} request(s) at the full context of "
                     f"{self.max_context:,} tokens")
        return "\n".join(lines)


def plan_memory(*, device: str, total: int, other: int, weights: int, state_slots: int,
                prefill_workspace: int, step_tokens: int, graph_workspace: int,
                kv_bytes_per_token: int, page_size: int, max_context: int, max_concurrency: int,
                kv_capacity: int | str, use_cuda_graphs: bool,
                spec_tokens: int = 0) -> MemoryPlan:
    """The plan for a device of `total` bytes, `other` of them not ours.

    "auto" gives the KV pool everything left (whole pages), capped at what max_concurrency
    requests of max_context tokens can use (plus the spec_tokens draft positions each), and
    refuses a device where not even one such request fits. An explicit capacity must fit
    (requests longer than it are refused at admission). kv_bytes_per_token counts every cache
    indexed by the pool's pages: the target's and a draft model's.
    """
    margin = max(MIN_MARGIN, int(MARGIN_FRACTION * total))
    graph_pool = GRAPH_POOL_FACTOR * graph_workspace if use_cuda_graphs else 0
    fixed = other + weights + state_slots + prefill_workspace + graph_pool + margin
    page_bytes = kv_bytes_per_token * page_size
    room_pages = max(0, total - fixed) // page_bytes
    request_pages = -(-(max_context + spec_tokens) // page_size)
    useful_pages = max_concurrency * request_pages
    if kv_capacity == "auto":
        pages = min(room_pages, useful_pages)
    else:
        pages = -(-int(kv_capacity) // page_size)
    plan = MemoryPlan(device=device, total=total, other=other, weights=weights,
                      state_slots=state_slots, prefill_workspace=prefill_workspace,
                      step_tokens=step_tokens,
                      graph_pool=graph_pool, margin=margin, kv=pages * page_bytes,
                      kv_bytes_per_token=kv_bytes_per_token, kv_capacity=pages * page_size,
                      page_size=page_size, max_context=max_context,
                      request_pages=request_pages)
    if pages > room_pages:
        raise MemoryPlanError(f"--kv-capacity {kv_capacity} does not fit: room for "
                              f"{room_pages * page_size:,} tokens\n{plan.table()}")
    if kv_capacity == "auto" and pages < request_pages:
        raise MemoryPlanError(f"not even one request of max_context {max_context:,} tokens "
                              f"fits in the KV pool; lower --max-context or "
                              f"--max-concurrency\n{plan.table()}")
    return plan


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes `fn` allocates at its peak on a CUDA device beyond what was allocated before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
