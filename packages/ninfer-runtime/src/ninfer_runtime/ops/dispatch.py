"""Which implementation an op runs: the torch reference or its Triton kernel.

`NINFER_OPS=auto` (default) runs a kernel when every tensor argument is on a CUDA device and
Triton is importable; `ref` always runs the reference (the oracle, and a way to bisect a wrong
result); `triton` always runs the kernel, which on a CPU-only machine needs TRITON_INTERPRET=1
(how CI tests the kernels).

A kernel that has not yet passed its tests on the GPU is registered with `validated=False`:
auto mode then keeps the reference, and only NINFER_OPS=triton runs it (its tests, and anyone
bisecting). Correctness first: a kernel earns auto mode by passing on real hardware.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

MODES = ("auto", "ref", "triton")
# kernels run by Triton's interpreter (CI): no PTX, no tuning, no launch options of real GPUs
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def ops_mode() -> str:
    mode = os.environ.get("NINFER_OPS", "auto")
    if mode not in MODES:
        raise ValueError(f"NINFER_OPS={mode!r}; expected one of {', '.join(MODES)}")
    return mode


def use_triton(*tensors: torch.Tensor, validated: bool = True) -> bool:
    """True when the op should launch its Triton kernel on these tensors."""
    return _launches(all(t.is_cuda for t in tensors), validated)


def runs_triton_on(*devices: torch.device, validated: bool = True) -> bool:
    """`use_triton` for tensors on these devices (what a plan asks before any exist)."""
    return _launches(all(d.type == "cuda" for d in devices), validated)


def _launches(on_cuda: bool, validated: bool) -> bool:
    mode = ops_mode()
    if mode == "ref" or not triton_available():
        return False
    return mode == "triton" or (validated and on_cuda)


_graphing = False


@contextmanager
def graph_kernels() -> Iterator[None]:
    """Within: the forward launches the kernels a CUDA graph can hold, also while it runs
    eagerly. The warm-up runs before a capture must launch (and autotune) the very kernels the
    capture records: an autotuner timing its configs inside a capture invalidates the graph
    (the 27B's engine start-up failed so when fla-core ran the warm-up's GDN prompt chunks
    and our own scan was first launched in the capture, docs/perf.md, twenty-second run)."""
    global _graphing
    before, _graphing = _graphing, True
    try:
        yield
    finally:
        _graphing = before


def graphing() -> bool:
    """Whether the forward must take graph-safe kernels: inside `graph_kernels` or a capture."""
    return _graphing or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
