"""The RMSNorm's arithmetic as Triton helpers, one definition for every kernel that normalises:
the norm kernels (ops.norm), q/k norm (ops.rope), and the kernels that run a deferred norm
(ops.norm.DeferredNorm) in their prologue (ops.skinny_linear, the activation pass of
ops.quant_decode), so that each gives the norm kernel's bits; and the launch arguments of
such a prologue (`prologue_args`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ninfer_runtime.ops.norm import DeferredNorm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the references run instead
    triton = None


def prologue_args(x: torch.Tensor, norm: DeferredNorm | None
                  ) -> tuple[torch.Tensor, tuple, dict]:
    """For a kernel that runs `norm` in its prologue, its input x [M, K] being the norm's
    output: the tensor it reads (the norm's input), the norm's arguments (h, weight,
    residual and output, h's row stride, eps) and constexprs (NORM, HAS_H, NORM_BD); without
    a norm, x and placeholders."""
    if norm is None:
        return x, (x, x, x, x, 0, 0.0), {"NORM": False, "HAS_H": False, "NORM_BD": 1}
    assert x.data_ptr() == norm.out.data_ptr() and x.shape == norm.out.shape, \
        "a deferred norm of another input"
    h = norm.x if norm.h is None else norm.h
    return (norm.x, (h, norm.weight, norm.residual, norm.out, h.stride(0), norm.eps),
            {"NORM": True, "HAS_H": norm.h is not None,
             "NORM_BD": triton.next_power_of_2(x.shape[1])})


if triton is not None:

    @triton.jit
    def inv_rms(x, D, eps):
        """1 / rms over axis 1 of a fp32 tile whose padding columns hold zeros.

        The squares are summed in fp64: the order of a fp32 sum follows the tile's layout,
        which Triton picks per tile shape and warp count, so that the GDN norm's rows came
        out in other bits when it also wrote the decode operand (a program per operand
        group's heads) than without (a GPU-only difference: the interpreter sums in one
        order). In fp64 the order reaches the fp32 result only at a rounding tie."""
        xd = x.to(tl.float64)
        return tl.rsqrt((tl.sum(xd * xd, axis=1) / D).to(tl.float32) + eps)

    @triton.jit
    def residual(x_ptrs, h_ptrs, mask, HAS_H: tl.constexpr):
        """x + h at the pointers, rounded to x's dtype as the residual stream is (x alone
        without h)."""
        x = tl.load(x_ptrs, mask=mask, other=0.0)
        if HAS_H:
            h = tl.load(h_ptrs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + h.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def normed(r, rstd, w, UNIT_OFFSET: tl.constexpr = True):
        """The norm of residual r at 1 / rms `rstd` with weight w (broadcast to r):
        r * rstd * (1 + w) in fp32, in that order (Qwen3.5's zero-centred weight; * w
        without UNIT_OFFSET), rounded to r's dtype."""
        scale = w.to(tl.float32)
        if UNIT_OFFSET:
            scale = 1.0 + scale
        return (r.to(tl.float32) * rstd * scale).to(r.dtype)

    @triton.jit
    def rows_inv_rms(x_ptr, stride_x, h_ptr, stride_h, rows, row_ok, K, eps,
                     HAS_H: tl.constexpr, BD: tl.constexpr):
        """1 / rms of the residual rows x + h [rows] of K inputs, each loaded whole (BD, a
        power of two >= K)."""
        cols = tl.arange(0, BD)
        r = residual(x_ptr + rows[:, None] * stride_x + cols[None, :],
                     h_ptr + rows[:, None] * stride_h + cols[None, :],
                     row_ok[:, None] & (cols < K)[None, :], HAS_H)
        return inv_rms(r.to(tl.float32), K, eps)
