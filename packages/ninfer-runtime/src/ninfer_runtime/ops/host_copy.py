"""Host values onto the GPU without waiting for it.

A copy from pageable host memory to the device first waits for every kernel already queued on
the stream (CUDA runtime API, "API synchronization behavior"), whatever `non_blocking` says:
the host then launches a step only once the GPU has drained the one before, and the GPU idles
while the host builds and launches. Overlapped decode (engine module docstring) exists to keep
the host one step ahead, so every per-step transfer is staged in pinned memory, which torch's
caching host allocator keeps alive until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a host list, nested for more dimensions) as a tensor on `device`, the copy
    queued behind the stream's work rather than waited for."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
