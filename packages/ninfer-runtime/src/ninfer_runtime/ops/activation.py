"""Activations.

`silu_and_mul` has a torch reference and a Triton kernel (ops.dispatch picks): one pass that
reads [gate | up] and writes the product, rounding silu(gate) to x.dtype before the multiply as
the reference's two bf16 ops do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_runtime.ops.dispatch import use_triton
from ninfer_runtime.ops.launch import options

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the reference still runs
    triton = None


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] input: x [..., 2I] -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] input: x [..., 2I] -> silu(gate) * up [..., I]."""
    if not use_triton(x):
        return silu_and_mul_ref(x)
    out = _launch_silu_and_mul(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1])


if triton is not None:
    from ninfer_runtime.ops.launch import wait_for_inputs

    @triton.jit
    def silu_mul(gate, up, dtype: tl.constexpr):
        """silu(gate) * up of fp32 gate and up in `dtype`, silu rounded to it first, as the
        reference's two ops round (the down projection's GEMV pass applies it too)."""
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (silu * up).to(dtype)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr,
                             GDC: tl.constexpr):
        """Row program_id(0), columns program_id(1)*BLOCK.. of the [M, I] output."""
        wait_for_inputs(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        src = x_ptr + row * stride_x + cols
        gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, silu_mul(gate, up, out_ptr.dtype.element_ty),
                 mask=mask)


def _launch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2I] (contiguous last dim) -> contiguous [M, I]."""
    assert x.dim() == 2 and x.stride(1) == 1, \
        f"silu_and_mul: need [M, 2I] with contiguous columns, got {tuple(x.shape)} {x.stride()}"
    m, width = x.shape
    assert width % 2 == 0, f"silu_and_mul: odd width {width}"
    inter = width // 2
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0 or inter == 0:
        return out
    # 1024 columns per program: 8 per thread in 4 warps, one 16-byte bf16 load each from gate
    # and up; 17408 (27B) and 512 (35B experts) split into whole blocks.
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(m, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), BLOCK=block, num_warps=max(1, min(4, block // 256)),
        **options(x.device))
    return out
