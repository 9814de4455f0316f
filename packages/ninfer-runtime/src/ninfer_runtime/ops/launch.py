"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A decode step is hundreds of small kernels, and between two of them the GPU idles while the
next one launches: on the H200 a CUDA-graph replay of the 35B-A3B step took 5.16 ms against
3.84 ms of kernel time. A kernel launched with PDL (Hopper and later) is scheduled while its
predecessor still runs. It must not read anything an earlier kernel may write before
`wait_for_inputs` returns: that waits until the predecessor grid has finished and its writes
are visible (and, since every PDL kernel waits before it ends, every earlier kernel's too),
then lets this kernel's own successor launch. So each kernel launched with `options(...)` calls
`wait_for_inputs` before it loads its inputs; what no kernel of a step writes may be loaded
before, so that its latency passes while the predecessor runs (the skinny GEMV's first weight
tile, 0.3-0.5 us a call on the H200; the GDN decode's state tile and first conv taps; paged
attention's place in the step's segments). Requests to L2 for the
decode GEMV's first tiles (`prefetch.global.L2`, or the bulk `prefetch_to_l2`) made it slower
(docs/perf.md, sixth and tenth runs). torch and cuBLAS kernels launch as usual and wait for
their predecessors in full.

On by default on Hopper and later (the interpreter never uses it): on the H200 it gave the
tokens of plain launches (the GPU test) and a 27B decode step 2.7% shorter (docs/perf.md).
NINFER_PDL=0 turns it off, for comparison.
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
    return (os.environ.get("NINFER_PDL", "1") == "1" and device.type == "cuda"
            and not INTERPRET
            and torch.cuda.get_device_capability(device)[0] >= 9)


@cache
def l2_prefetch(device: torch.device) -> bool:
    """Whether kernels on `device` may use `prefetch_to_l2`: off unless NINFER_L2_PREFETCH=1
    (Hopper and later, never under the interpreter). On the H200 it made the 27B decode step
    slower (10.71 ms against 9.83 ms without, docs/perf.md), so it stays for experiments."""
    return (os.environ.get("NINFER_L2_PREFETCH", "0") == "1" and device.type == "cuda"
            and not INTERPRET and torch.cuda.get_device_capability(device)[0] >= 9)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for operands of a model in `dtype`: an fp32 model (the
    oracle the tests compare with) gets exact fp32 products, any other TF32, which is finer
    than its own bf16 or fp16 operands."""
    return "ieee" if dtype == torch.float32 else "tf32"


def options(device: torch.device) -> dict:
    """Launch arguments of a PDL kernel on `device`: its GDC constexpr and Triton's
    launch_pdl, both off where PDL is not used."""
    on = _pdl(torch.device(device))
    return {"GDC": on, "launch_pdl": on}


# per program: with up to 4 programs on each of 132 SMs, ~25 MB of the H200's 50 MB L2
PREFETCH_BYTES = 48 << 10

if triton is not None:
    _PREFETCH_BYTES = tl.constexpr(PREFETCH_BYTES)

    @triton.jit
    def wait_for_inputs(GDC: tl.constexpr):
        """A PDL kernel's first step (no-op when GDC is off): wait for the predecessor grid's
        writes, then let the successor grid launch."""
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_to_l2(ptrs, nbytes):
        """Ask L2 for `nbytes` contiguous bytes at each of `ptrs`, at most PREFETCH_BYTES in
        all (sm_90 bulk prefetch: one instruction a row, nothing waits on it; 16-byte aligned
        addresses and sizes). Issued before `wait_for_inputs`, a kernel's first weights stream
        in while its predecessor runs, and more of its bytes are in flight at once than a
        pipeline's few stages hold."""
        nbytes = tl.minimum(nbytes, _PREFETCH_BYTES // ptrs.numel // 16 * 16)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;", "=r,l,r",
            [ptrs.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)
