"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A decode step is hundreds of small kernels, and between two of them the GPU idles while the
next one launches: on the H200 a CUDA-graph replay of the 35B-A3B step took 5.16 ms against
3.84 ms of kernel time. A kernel launched with PDL (Hopper and later) is scheduled while its
predecessor still runs. It must not read anything before `wait_for_inputs` returns: that waits
until the predecessor grid has finished and its writes are visible (and, since every PDL kernel
waits before it ends, every earlier kernel's too), then lets this kernel's own successor launch.
So each kernel launched with `options(...)` calls `wait_for_inputs` before its first load;
torch and cuBLAS kernels launch as usual and wait for their predecessors in full.

Off until it has run on a GPU: NINFER_PDL=1 turns it on (Hopper and later; the interpreter
never uses it).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from ninfer_runtime.ops.dispatch import INTERPRET

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: nothing here is used
    triton = None


@cache
def _pdl(device: torch.device) -> bool:
    return (os.environ.get("NINFER_PDL", "0") == "1" and device.type == "cuda"
            and not INTERPRET
            and torch.cuda.get_device_capability(device)[0] >= 9)


def options(device: torch.device) -> dict:
    """Launch arguments of a PDL kernel on `device`: its GDC constexpr and Triton's
    launch_pdl, both off where PDL is not used."""
    on = _pdl(torch.device(device))
    return {"GDC": on, "launch_pdl": on}


if triton is not None:

    @triton.jit
    def wait_for_inputs(GDC: tl.constexpr):
        """A PDL kernel's first step (no-op when GDC is off): wait for the predecessor grid's
        writes, then let the successor grid launch."""
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
