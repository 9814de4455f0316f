"""The ceilings every ratio of ninfer-bench divides by, for the GPU it runs on.

Measured at first use, the way BENCHMARKS.md measured the H200 (copy bandwidth, bytes read plus
written, 4.24 TB/s; bf16 matmul at 8192^3 on random data, 789 TFLOP/s): the lent machines are
H200s or H100s (4.8 and 3.35 TB/s on paper), and a ratio against another card's ceiling misleads.
The best of a few timed runs, since a ceiling is what the card can do. Without a GPU (the
benches' CPU tests) the H200's published figures stand in; ratios there mean nothing anyway.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # B/s: bytes read + written by a device-to-device copy
    bf16_flops: float  # FLOP/s: a bf16 8192^3 matmul
    source: str

    def describe(self) -> str:
        return (f"ceilings {self.bandwidth / 1e12:.2f} TB/s copy bandwidth, "
                f"{self.bf16_flops / 1e12:.0f} TFLOP/s bf16 ({self.source})")


H200 = Ceilings(4.24e12, 789e12, "the H200's of BENCHMARKS.md: no GPU here")


@functools.cache
def ceilings(device: str = "cuda") -> Ceilings:
    """The ceilings of `device` (its current CUDA device when only "cuda" is named)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return H200
    with torch.cuda.device(torch.device(device)):
        measured = Ceilings(_copy_bandwidth(), _matmul_flops(),
                            f"measured on this {torch.cuda.get_device_name()}")
        torch.cuda.empty_cache()  # the engine's memory plan must not see the buffers as used
    return measured


def against_bandwidth(moved: float, us: float) -> dict:
    """A memory-bound row's ceiling and ratio: `moved` bytes in `us` microseconds."""
    bandwidth = ceilings().bandwidth
    return {"ceiling": f"{bandwidth:.3g} B/s", "ratio_to_ceiling": moved / bandwidth / (us * 1e-6)}


def against_flops(flops: float, us: float) -> dict:
    """A compute-bound row's ceiling and ratio: `flops` bf16 operations in `us` microseconds."""
    rate = ceilings().bf16_flops
    return {"ceiling": f"{rate:.3g} FLOP/s", "ratio_to_ceiling": flops / rate / (us * 1e-6)}


def _best_seconds(run: Callable[[], object], reps: int = 10) -> float:
    run()  # the first call pays for cuBLAS's heuristics and the allocator
    best = math.inf
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    return best


def _copy_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src))


def _matmul_flops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    return 2 * n ** 3 / _best_seconds(lambda: a @ b)
