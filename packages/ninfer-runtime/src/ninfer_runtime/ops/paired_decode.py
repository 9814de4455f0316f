"""A small plain weight's GEMV beside a packed weight's decode GEMV of the same rows, one launch.

A GDN layer's two input projections read the same normed rows: in_proj_ba, plain bf16 and
small ([2 x 48, 5120] on the 27B), and in_proj_qkvz, packed and large ([16384, 5120]). As two
launches the skinny GEMV (`skinny_linear`, which also wrote in_proj_qkvz's operand) ran its
whole dependent chain first (the rows' tiles, 40 K parts' arrival and their sum: in_proj_ba
cost 4.4 us a layer of the H100's 27B step, docs/perf.md, thirty-first run), and the packed
GEMV could not start before it ended. Here one launch runs both: the small weight's row tiles
are its first programs, each over the whole K (no parts to add, a handful of programs that
take the SM slots the packed grid leaves, or hold a few of its programs back by their own
short time), and the packed GEMV's (row tile, K split) programs follow in the order its own
kernel runs them, with the plan tuned for it (`quant_linear._decode_plan`). An activation pass
before the launch makes the packed GEMV's operand (0.4 us a launch in the same run).

The packed product has the bits of `quant_linear.packed_linear`; the small one those of
`skinny_linear` with K unsplit (its K tiles summed in order in one program). NINFER_PAIRED=0
runs the two launches instead, the A/B of this change.
"""

from __future__ import annotations

import os

import torch

from ninfer_runtime.ops import skinny_linear
from ninfer_runtime.ops.compile_ahead import launch
from ninfer_runtime.ops.dispatch import INTERPRET
from ninfer_runtime.ops.launch import options
from ninfer_runtime.ops.quant_linear import (
    _REGISTERS,
    _decode_args,
    _decode_plan,
    _operands,
    decodes,
    tile_counters,
)
from ninfer_runtime.quant import PackedWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the callers take the two launches
    triton = None

PAIRED = os.environ.get("NINFER_PAIRED", "1") != "0"


def applies(x: torch.Tensor, small: torch.Tensor) -> bool:
    """Whether x [M, K] @ small^T takes the skinny kernel beside a packed decode GEMV of x
    (the caller checks that the packed weight takes the decode kernels)."""
    return (PAIRED and triton is not None and decodes(x) and x.stride(1) == 1
            and skinny_linear.applies(x, small))


def paired_decode(x: torch.Tensor, small: torch.Tensor, packed: PackedWeight
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ small^T, x @ dequantize(packed)^T) for a decode step's x [M, K], in x's dtype, from
    one launch (`_paired_kernel`); see `applies`."""
    ops = _operands(packed)
    n, k = packed.shape
    assert small.shape[1] == k and x.dim() == 2 and x.shape[1] == k, \
        f"paired_decode: x {tuple(x.shape)}, weights {tuple(small.shape)}, {n} x {k}"
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    small_out = torch.empty((m, small.shape[0]), dtype=x.dtype, device=x.device)
    plan = _decode_plan(x, ops, out)
    grid, args, kw, _ = _decode_args(x, ops, out, plan, False, None, None,
                                     tile_counters(x.device, 0))
    tile = skinny_linear.tile_options(x)
    small_tiles = triton.cdiv(small.shape[0], tile["BN"])
    if not INTERPRET:  # the occupancy the packed plan was tuned at (`DecodeConfig.per_sm`)
        kw["maxnreg"] = _REGISTERS // (plan.config.per_sm * 32 * kw["num_warps"]) // 8 * 8
    launch(_paired_kernel, (small_tiles + grid[0] * grid[1],), x, small, small_out,
           x.stride(0), small.shape[0], small.stride(0), small_tiles, *args, grid[0],
           S_BN=tile["BN"], S_BK=tile["BK"], **kw, **options(x.device))
    return small_out, out


if triton is not None:
    from ninfer_runtime.ops.quant_linear import _decode_item
    from ninfer_runtime.ops.skinny_linear import skinny_item

    @triton.jit
    def _paired_kernel(
        x_ptr, sw_ptr, s_out_ptr, stride_x, s_N, s_stride_w, s_tiles,
        xo_ptr, inv_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, g_ptr, part_ptr, counter_ptr, out_ptr,
        hidden_ptr, hxo_ptr, hinv_ptr, hxsum_ptr, ticket_ptr, M, N, K, stride_w, stride_s,
        split_len, splits, tiles, S_BN: tl.constexpr, S_BK: tl.constexpr,
        SCHEME: tl.constexpr, WPS: tl.constexpr, BM: tl.constexpr, ASM: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        DOTS: tl.constexpr, HAND_ON: tl.constexpr, OUT_GROUP: tl.constexpr,
        OUT_SUMS: tl.constexpr, PREFETCH: tl.constexpr, GDC: tl.constexpr
    ):
        """Programs [0, s_tiles): row tile pid of s_out = x @ sw^T over the whole K
        (`skinny_item`, one part: its part buffer is s_out, no counter is touched); the rest:
        the packed GEMV's items (`_decode_item`), row tile fastest as in its own grid."""
        pid = tl.program_id(0)
        if pid < s_tiles:
            skinny_item(pid, 0, 1, x_ptr, sw_ptr, s_out_ptr, counter_ptr, s_out_ptr, M, s_N, K,
                        stride_x, s_stride_w, K, BM, S_BN, S_BK, GDC)
        else:
            item = pid - s_tiles
            _decode_item(item % tiles, item // tiles, splits, xo_ptr, inv_ptr, xsum_ptr, w_ptr,
                         s_ptr, z_ptr, g_ptr, part_ptr, counter_ptr, out_ptr, hidden_ptr,
                         hxo_ptr, hinv_ptr, hxsum_ptr, ticket_ptr, M, N, K, stride_w, stride_s,
                         split_len, SCHEME, WPS, BM, ASM, EVEN_K, EVEN_N, BN, BK, DOTS,
                         HAND_ON, OUT_GROUP, OUT_SUMS, PREFETCH, GDC)
