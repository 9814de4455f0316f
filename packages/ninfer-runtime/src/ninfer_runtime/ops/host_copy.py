"""Host values onto the GPU without waiting for it.

Overlapped decode (engine module docstring) keeps the host one step ahead of the GPU, so no
per-step transfer may make the host wait for the work queued on the stream. An asynchronous
copy from pageable host memory is staged by the driver, which "may synchronize with the
stream" to do so (CUDA runtime API, "API synchronization behavior"); from pinned memory it
never waits. So every per-step transfer is staged in pinned memory, which torch's caching
host allocator keeps alive until the copy has run. (On an H100 the pageable copies had cost
nothing measurable: the 35B decoded at 393-395 tok/s with them and 394-396 pinned,
docs/perf.md, thirty-sixth run.)
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
