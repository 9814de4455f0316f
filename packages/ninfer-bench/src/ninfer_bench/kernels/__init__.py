"""Per-op kernel microbenchmarks: each module here has `bench(device="cuda")`, an iterable of
row dicts (a generator yields each row as it is measured, which `ninfer-bench kernels` writes
out at once, so that a run cut by a time limit keeps its rows).

Rows carry op, shape, time_us and the ratio to the op's ceiling (bandwidth for memory-bound
ops, bf16 tensor-core FLOPs for compute-bound ones); `ninfer-bench kernels` runs them all.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable

BenchFn = Callable[..., Iterable[dict]]


def suites() -> dict[str, BenchFn]:
    """Every kernel benchmark module in this package, by name."""
    return {
        m.name: importlib.import_module(f"{__name__}.{m.name}").bench
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_")
    }
