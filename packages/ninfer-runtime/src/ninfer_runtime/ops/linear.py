"""Linear layers over plain or packed (quantized) weights.

The reference (`linear_ref`) dequantizes a `PackedWeight` on every call and caches nothing.
On the GPU a packed nvfp4 / groupwise-int weight runs the Triton kernels of `quant_linear`,
which read the packed bytes directly (a decode GEMV for M <= 16 rows, a dequantizing
tensor-core GEMM above); plain bf16 weights go to F.linear (cuBLAS is their ceiling), but for
a few rows through a small one (`skinny_linear`: one kernel where cuBLAS launches two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_runtime.ops import quant_linear, skinny_linear
from ninfer_runtime.ops.activation import silu_and_mul
from ninfer_runtime.ops.dispatch import use_triton
from ninfer_runtime.ops.norm import DeferredNorm, run_deferred
from ninfer_runtime.quant import PackedWeight

Weight = torch.Tensor | PackedWeight


def linear_ref(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T -> [..., out] in x.dtype; a packed w is dequantized first."""
    weight = w.dequantize(x.dtype) if isinstance(w, PackedWeight) else w
    return F.linear(x, weight)


def _packed_kernels(x: torch.Tensor, w: Weight) -> bool:
    """Whether x @ w^T runs quant_linear's kernels (a packed weight they take, on CUDA)."""
    return (isinstance(w, PackedWeight) and quant_linear.supports(w)
            and use_triton(x, *w.parts.values()))


def linear(x: torch.Tensor, w: Weight, operand: quant_linear.DecodeOperand | None = None,
           norm: DeferredNorm | None = None) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T -> [..., out], in x.dtype (see `linear_ref`). operand: x's
    decode operand, made with x by the norm that produced it (`decode_operand_spec`). norm:
    the norm whose output x is, not yet run: the product's first launch runs it where it
    can (a skinny GEMV's prologue, the decode GEMV's activation pass), else it runs first."""
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(w, torch.Tensor):
        if not skinny_linear.applies(rows, w):
            run_deferred(norm)
            return F.linear(x, w)
        out = skinny_linear.skinny_linear(rows, w, norm=norm)
    elif _packed_kernels(x, w):
        out = quant_linear.packed_linear(rows if rows.stride(-1) == 1 else rows.contiguous(), w,
                                         operand=operand, norm=norm)
    else:
        run_deferred(norm)
        return linear_ref(x, w)
    return out.view(*x.shape[:-1], w.shape[0])


def decode_operand_spec(x: torch.Tensor, w: Weight) -> tuple[int, bool] | None:
    """(group, sums) of the decode operand `linear(y, w)` would make of a y like x [M, K]
    (norm output: same shape, dtype and device), for the norm that makes y to write it
    (ops.norm.gated_rms_norm_with_operand); None where linear would not run the decode
    GEMV."""
    if x.dim() != 2 or not quant_linear.decodes(x) or not _packed_kernels(x, w):
        return None
    return quant_linear.operand_group(w), quant_linear.needs_group_sums(w)


def linear_with_operand(x: torch.Tensor, w: Weight, spec: tuple[int, bool] | None,
                        norm: DeferredNorm | None = None
                        ) -> tuple[torch.Tensor, quant_linear.DecodeOperand | None]:
    """linear(x, w), and x's decode operand of `spec` (group, sums: `decode_operand_spec` of
    the packed weight that reads x next, or None) written by the same launch where w takes
    `skinny_linear`: the next GEMV then runs no activation pass of its own. Elsewhere the
    operand is None. `norm`: the norm whose output x is, not yet run; the same launch runs
    it where `skinny_linear` can, else it runs first."""
    rows = x.reshape(-1, x.shape[-1])
    if spec is None or not isinstance(w, torch.Tensor) or not skinny_linear.applies(rows, w):
        return linear(x, w, norm=norm), None
    operand = quant_linear.DecodeOperand.empty(*rows.shape, *spec, x.device)
    out = skinny_linear.skinny_linear(rows, w, operand, norm)
    return out.view(*x.shape[:-1], w.shape[0]), operand


def swiglu_with_operand(x: torch.Tensor, w: Weight, spec: tuple[int, bool] | None,
                        norm: DeferredNorm | None = None
                        ) -> tuple[torch.Tensor, quant_linear.DecodeOperand] | None:
    """(silu_and_mul(linear(x, w)), its decode operand of `spec`) for a fused [gate | up]
    weight w, from one launch of the decode GEMV (`quant_linear.swiglu_decode`; its
    activation pass runs `norm`, the norm whose output x is, not yet run), where w takes that
    GEMV and `spec` is the down projection's (`decode_operand_spec`); else None (the caller
    runs linear, then `silu_mul_linear`, and the norm)."""
    rows = x.reshape(-1, x.shape[-1])
    if (spec is None or rows.stride(-1) != 1 or not quant_linear.decodes(rows)
            or not _packed_kernels(x, w)):
        return None
    fused = quant_linear.swiglu_decode(rows, w, spec, norm)
    if fused is None:
        return None
    hidden, operand = fused
    return hidden.view(*x.shape[:-1], hidden.shape[-1]), operand


def mlp_decode(x: torch.Tensor, gate_up: Weight, down: Weight,
               norm: DeferredNorm | None = None) -> torch.Tensor | None:
    """linear(silu_and_mul(linear(x, gate_up)), down) for a decode step's rows, both GEMVs in
    one launch (`quant_linear.mlp_decode`, after the activation pass that runs `norm`, the
    norm whose output x is, not yet run) where both weights take the decode GEMV (and
    NINFER_MLP_BLOCK is not 0); else None (the caller runs `swiglu_with_operand`, then the
    down GEMV, and the norm)."""
    rows = x.reshape(-1, x.shape[-1])
    if (not quant_linear.MLP_BLOCK or rows.stride(-1) != 1 or not quant_linear.decodes(rows)
            or not _packed_kernels(x, gate_up) or not _packed_kernels(x, down)):
        return None
    out = quant_linear.mlp_decode(rows, gate_up, down, norm)
    return None if out is None else out.view(*x.shape[:-1], out.shape[-1])


def silu_mul_linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """linear(silu_and_mul(x), w) for x [..., 2I] ([gate | up]) and w [out, I]. A decode
    step's few rows through a packed weight take the SiLU in the GEMV's activation pass: one
    launch fewer per MLP."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) == 1 and quant_linear.decodes(rows) and _packed_kernels(x, w):
        out = quant_linear.packed_linear(rows, w, swiglu=True)
        return out.view(*x.shape[:-1], w.shape[0])
    return linear(silu_and_mul(x), w)


def select(w: Weight, index: int) -> Weight:
    """w[index] along the leading (expert) dim, keeping a packed weight packed."""
    if isinstance(w, PackedWeight):
        return PackedWeight(w.scheme, {role: part[index] for role, part in w.parts.items()},
                            w.shape[1:])
    return w[index]
