"""Per-op kernel microbenchmarks: each module here has `bench(device="cuda") -> list[dict]`.

Rows carry op, shape, time_us and the ratio to the op's ceiling (bandwidth for memory-bound
ops, bf16 tensor-core FLOPs for compute-bound ones); `ninfer-bench kernels` runs them all.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

BenchFn = Callable[..., list[dict]]


def suites() -> dict[str, BenchFn]:
    """Every kernel benchmark module in this package, by name."""
    return {
        m.name: importlib.import_module(f"{__name__}.{m.name}").bench
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_")
    }
