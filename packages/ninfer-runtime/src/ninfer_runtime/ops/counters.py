"""Arrival counters for kernels whose last program to arrive finishes the work.

Several kernels split one result over programs and let the last one to arrive finish it: the
split-K decode GEMMs sum their K parts, gdn_decode's programs hand on to the output norm, the
sampler's last vocabulary chunk picks the token. Each program bumps an int32 counter with an
atomic; the one that reads count - 1 finishes and sets the counter back to 0. A pool that
starts zeroed therefore stays zeroed between calls and graph replays, so one allocation per
device serves every launch, and its address never changes, so captured graphs keep it.

Each kernel family has its own pool: with programmatic dependent launch the next kernel starts
while the last one's programs still count, and a shared pool would mix their counts. For the
same reason two streams running one family at once would each need their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@dataclass(frozen=True)
class CounterPool:
    """`size` zeroed int32 counters per device for the kernels that `name` says."""

    name: str
    size: int

    def on(self, device: torch.device, needed: int = 0) -> torch.Tensor:
        assert needed <= self.size, \
            f"{self.name}: {needed} counters needed, the pool holds {self.size}"
        return _zeroed(self.name, self.size, device)


@cache
def _zeroed(name: str, size: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.int32, device=device)
