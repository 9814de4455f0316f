"""A few rows through a small plain (bf16) weight: one Triton kernel instead of cuBLAS's two.

The unquantized projections a decode step runs are small: GDN's in_proj_ba ([2 x 48, 5120] on
the 27B, 48 layers) and the MoE router with its shared-expert gate ([257, 2048] on the 35B-A3B,
40 layers), about 1 MB each. cuBLAS runs such a GEMV as a split-K kernel and a reduce kernel:
the H200 profile of a 27B decode step shows 222 + 69 us over the 48 in_proj_ba calls (~6 us
for a megabyte, ~4% of bandwidth), and neither launch takes part in programmatic dependent
launch (ops.launch). Here a program multiplies BN weight rows over one K split on tensor cores
(the activation rows padded to 8 or 16, the dot's N); the last split of a row tile to arrive
adds the parts in a fixed order (`quant_linear.sum_parts`), so results do not depend on
scheduling and no second kernel runs.

Both of these read the same input as a packed projection beside them: in_proj_ba beside
in_proj_qkvz, the router beside the experts' gate|up. So the kernel can also write that input's
decode operand (quant_linear.DecodeOperand), one operand group per program, side by side with
its own product: the packed GEMV after it then runs no activation pass, one launch fewer in the
chain (as the GDN output norm spares out_proj's).

On the H200 (docs/perf.md, fifth run) its tests pass and the 27B in_proj_ba at one row takes
4.9 us against cuBLAS's 7.2 (5.4 against 7.3 at eight rows); 3.4 us since the tenth run.

Both also read the output of the RMSNorm before them (the layer's input norm before in_proj_ba,
the post-attention norm before the router), a launch of one program at decode. The kernel can
run that norm in its prologue (`ops.norm.DeferredNorm`): every program computes its rows'
1 / rms from the whole rows of x + h (a few KB from L2), normalises its own K split on the way
into the dot, and the first row tile's programs store their splits of the residual and the
normed rows; the operand groups are normalised as they are written. The bits are the norm
kernel's (the squares summed in fp64, the same rounding points), and the product's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_runtime.ops import quant_linear
from ninfer_runtime.ops.dispatch import use_triton
from ninfer_runtime.ops.launch import options
from ninfer_runtime.ops.norm import DeferredNorm
from ninfer_runtime.ops.rms_math import prologue_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: linear() runs F.linear
    triton = None

MAX_ROWS = 16  # activation rows (a decode or verify step); more take F.linear
MAX_WEIGHT_BYTES = 4 << 20  # larger weights stream well enough through cuBLAS
_BN = 16  # weight rows per program
_BK = 128  # inputs per K iteration
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 64  # never binding below K = 8192 at BK 128: K alone bounds the splits
# the prologue norm holds its rows of x + h at once (next_pow2(M) x next_pow2(K), x and h:
# 64 registers a thread at 4 warps); more rows run the norm kernel first
_NORM_ELEMENTS = 8192


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x [M, K] @ w [N, K]^T is a skinny product this kernel takes on this device."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and w.dim() == 2
            and w.stride(1) == 1 and x.stride(1) == 1
            and w.numel() * w.element_size() <= MAX_WEIGHT_BYTES
            and use_triton(x, w))


def k_split(n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(split_len, splits): enough K splits that the row tiles fill the GPU about twice."""
    return quant_linear.k_split(n, k, device, _PROGRAMS_PER_SM, tile_rows=_BN, granule=_BK,
                                max_splits=_MAX_SPLITS)


@dataclass(frozen=True)
class Launch:
    """One launch of the skinny kernel (or ops.moe's router built on it) for x [M, K] @ w^T:
    its output, the K parts' fp32 buffer (the output itself when K is not split), the grid
    (row tiles, K splits) and the split length."""

    out: torch.Tensor
    parts: torch.Tensor
    grid: tuple[int, int]
    split_len: int

    @classmethod
    def of(cls, x: torch.Tensor, n: int) -> Launch:
        m, k = x.shape
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        split_len, splits = k_split(n, k, x.device)
        parts = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32,
                                                    device=x.device)
        return cls(out, parts, (triton.cdiv(n, _BN), splits), split_len)

    def args(self, x: torch.Tensor, w: torch.Tensor, counters: int) -> tuple:
        """The arguments the kernels share, up to the operand buffers, with a counter for each
        row tile and `counters` more after them."""
        tiles = self.grid[0]
        return (x, w, self.parts, quant_linear.TILE_COUNTERS.on(x.device, tiles + counters),
                self.out)

    def sizes(self, x: torch.Tensor, w: torch.Tensor) -> tuple:
        """The sizes and strides the kernels share, after the operand buffers."""
        return x.shape[0], w.shape[0], x.shape[1], x.stride(0), w.stride(0), self.split_len


def operand_args(x: torch.Tensor, operand: quant_linear.DecodeOperand | None
                 ) -> tuple[tuple, dict]:
    """The operand buffers and constexprs of the kernels' `write_operand` for x [M, K]."""
    if operand is None:
        return quant_linear.operand_buffers(None, x), {"OPERAND": False, "GROUP": _BK,
                                                       "HAS_SUM": False}
    m, k = x.shape
    assert operand.xo.shape == (8, m, k // 8) and k % 8 == 0, \
        f"skinny_linear: an operand of {tuple(operand.xo.shape)} for x {tuple(x.shape)}"
    return (quant_linear.operand_buffers(operand, x),
            {"OPERAND": True, "GROUP": operand.group, "HAS_SUM": operand.sums})


def takes_norm(norm: DeferredNorm) -> bool:
    """Whether the kernel can run `norm` in its prologue (its rows fit `_NORM_ELEMENTS`)."""
    m, k = norm.x.shape
    return (norm.x.stride(1) == 1 and (norm.h is None or norm.h.stride(1) == 1)
            and triton.next_power_of_2(m) * triton.next_power_of_2(k) <= _NORM_ELEMENTS)


def norm_args(x: torch.Tensor, norm: DeferredNorm | None) -> tuple[torch.Tensor, tuple, dict]:
    """`rms_math.prologue_args` for the kernels' input x [M, K], with the rows the prologue
    loads at once (NORM_ROWS). A norm the prologue cannot take (`takes_norm`) runs here, by
    the norm kernel, and the kernels read x."""
    if norm is not None and not takes_norm(norm):
        norm.run()
        norm = None
    source, args, constexprs = prologue_args(x, norm)
    rows = 1 if norm is None else triton.next_power_of_2(x.shape[0])
    return source, args, {**constexprs, "NORM_ROWS": rows}


def tile_options(x: torch.Tensor) -> dict:
    """The tile constexprs and launch options of the kernels for x [M, K]."""
    return {"BM": quant_linear.decode_rows(x.shape[0]), "BN": _BN, "BK": _BK, "num_warps": 4,
            **options(x.device)}


def skinny_linear(x: torch.Tensor, w: torch.Tensor,
                  operand: quant_linear.DecodeOperand | None = None,
                  norm: DeferredNorm | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x.dtype, fp32 accumulation (as F.linear). With
    `operand` (unwritten buffers, `DecodeOperand.empty` of x's shape), the same launch writes
    x's decode operand into it, the bits `quant_linear.activation_operands` would make. With
    `norm` (the norm whose output x is, not yet run), the launch runs it first where its
    prologue can (`takes_norm`); else the norm kernel runs before it."""
    launch = Launch.of(x, w.shape[0])
    buffers, operand_options = operand_args(x, operand)
    source, norm_buffers, norm_options = norm_args(x, norm)
    _skinny_kernel[launch.grid](*launch.args(source, w, 0), *buffers, *norm_buffers,
                                *launch.sizes(source, w), **operand_options, **norm_options,
                                **tile_options(x))
    return launch.out


if triton is not None:
    from ninfer_runtime.ops.launch import wait_for_inputs
    from ninfer_runtime.ops.quant_decode import store_operand
    from ninfer_runtime.ops.quant_linear import split_program, sum_parts
    from ninfer_runtime.ops.rms_math import normed, residual, rows_inv_rms

    # K parts the last program of a row tile loads at once (`quant_linear.sum_parts`): a part
    # is [BM, BN] = at most 16 x 16 fp32, 2 registers a thread, so the 27B in_proj_ba's 40
    # parts take 2 rounds of L2 round trips at the kernel's end instead of the decode GEMV's 5
    _PARTS_IN_FLIGHT = tl.constexpr(32)

    @triton.jit
    def _weight_tile(w_rows, row_ok, k0, k_hi, BK: tl.constexpr):
        """w[rows, k0:k0 + BK] (zero past k_hi and past the last row)."""
        ks = k0 + tl.arange(0, BK)
        return tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & (ks < k_hi)[None, :],
                       other=0.0)

    @triton.jit
    def _input_tile(x_ptr, stride_x, ms, m_ok, k0, k_hi, BK: tl.constexpr):
        """x[ms, k0:k0 + BK]^T (zero past k_hi and past the last row)."""
        ks = k0 + tl.arange(0, BK)
        return tl.load(x_ptr + ms[None, :] * stride_x + ks[:, None],
                       mask=(ks < k_hi)[:, None] & m_ok[None, :], other=0.0)

    @triton.jit
    def _input_rows(x_ptr, stride_x, h_ptr, stride_h, nw_ptr, rstd, ms, m_ok, ks, k_ok,
                    NORM: tl.constexpr, HAS_H: tl.constexpr):
        """x[ms, ks] [BM, C], or with NORM the prologue norm's output there (x the norm's
        input, + h, at 1 / rms `rstd` [BM]), and the residual x + h."""
        mask = m_ok[:, None] & k_ok[None, :]
        r = residual(x_ptr + ms[:, None] * stride_x + ks[None, :],
                     h_ptr + ms[:, None] * stride_h + ks[None, :], mask, HAS_H and NORM)
        y = r
        if NORM:
            y = normed(r, rstd[:, None], tl.load(nw_ptr + ks, mask=k_ok, other=0.0)[None, :])
        return y, r

    @triton.jit
    def _dot_input(x_ptr, stride_x, h_ptr, stride_h, nw_ptr, res_ptr, normed_ptr, K, rstd,
                   ms, m_ok, k0, k_hi, stored_rows, NORM: tl.constexpr, HAS_H: tl.constexpr,
                   BK: tl.constexpr):
        """The dot's input tile [BK, BM] at k0: x's (`_input_tile`), or the prologue norm's
        output, whose first `stored_rows` rows (with their residual) the program writes to
        normed_ptr (res_ptr)."""
        if NORM:
            ks = k0 + tl.arange(0, BK)
            y, r = _input_rows(x_ptr, stride_x, h_ptr, stride_h, nw_ptr, rstd, ms, m_ok, ks,
                               ks < k_hi, NORM, HAS_H)
            dst = ms[:, None] * K + ks[None, :]
            mask = (ms < stored_rows)[:, None] & (ks < k_hi)[None, :]
            tl.store(normed_ptr + dst, y, mask=mask)
            if HAS_H:
                tl.store(res_ptr + dst, r, mask=mask)
            tile = tl.trans(y)
        else:
            tile = _input_tile(x_ptr, stride_x, ms, m_ok, k0, k_hi, BK)
        return tile

    @triton.jit
    def write_operand(x_ptr, stride_x, h_ptr, stride_h, nw_ptr, rstd, M, K, xo_ptr, inv_ptr,
                      xsum_ptr, BM: tl.constexpr, GROUP: tl.constexpr, HAS_SUM: tl.constexpr,
                      NORM: tl.constexpr, HAS_H: tl.constexpr):
        """x's decode operand (with NORM: of the prologue norm's output), group g by the g-th
        program in launch order (`store_operand`, as `activation_kernel` does it a row at a
        time: the same bits)."""
        programs = tl.num_programs(0) * tl.num_programs(1)
        ms = tl.arange(0, BM)
        m_ok = ms < M
        for g in range(tl.program_id(1) * tl.num_programs(0) + tl.program_id(0),
                       tl.cdiv(K, GROUP), programs):
            ks = g * GROUP + tl.arange(0, GROUP)
            x, _ = _input_rows(x_ptr, stride_x, h_ptr, stride_h, nw_ptr, rstd, ms, m_ok, ks,
                               ks < K, NORM, HAS_H)
            store_operand(x.to(tl.float32), ms, m_ok, g * GROUP, M, K, xo_ptr, inv_ptr,
                          xsum_ptr, GROUP, HAS_SUM)

    @triton.jit
    def skinny_part(x_ptr, w_ptr, part_ptr, counter_ptr, out_ptr, h_ptr, nw_ptr, res_ptr,
                    normed_ptr, stride_h, eps, M, N, K, stride_x, stride_w, split_len,
                    NORM: tl.constexpr, HAS_H: tl.constexpr, NORM_ROWS: tl.constexpr,
                    NORM_BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, GDC: tl.constexpr):
        """This program's part of out: rows of tile pid 0 over K split pid 1 of
        num_programs(1); whether it stored its tile's finished rows (the last part to arrive),
        and with NORM its rows' 1 / rms (the prologue norm, module docstring; the first row
        tile stores the norm's output and residual). The first K tile of the weight (which
        no kernel of a step writes; most programs have only one) is loaded before the wait
        for the inputs, so that its DRAM latency passes while the predecessor still runs:
        0.3-0.5 us a call on the H200 (docs/perf.md, tenth run)."""
        tile, part, rows, row_ok, ms, m_ok, k_lo, k_hi = split_program(M, N, K, split_len, BM,
                                                                       BN)
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
        w = _weight_tile(w_rows, row_ok, k_lo, k_hi, BK)
        wait_for_inputs(GDC)
        rstd = tl.zeros((BM,), tl.float32)
        if NORM:  # the rows at once (NORM_ROWS, a power of two >= M), then as [BM]
            m = tl.arange(0, NORM_ROWS)
            rows_rstd = rows_inv_rms(x_ptr, stride_x, h_ptr, stride_h, m, m < M, K, eps, HAS_H,
                                     NORM_BD)
            rstd = tl.sum(tl.where(ms[:, None] == m[None, :], rows_rstd[None, :], 0.0), axis=1)
        stored_rows = tl.where(tile == 0, M, 0)  # the first row tile stores the norm's rows
        acc = tl.dot(w, _dot_input(x_ptr, stride_x, h_ptr, stride_h, nw_ptr, res_ptr,
                                   normed_ptr, K, rstd, ms, m_ok, k_lo, k_hi, stored_rows, NORM,
                                   HAS_H, BK), tl.zeros((BN, BM), tl.float32))
        for k0 in range(k_lo + BK, k_hi, BK):
            acc = tl.dot(_weight_tile(w_rows, row_ok, k0, k_hi, BK),
                         _dot_input(x_ptr, stride_x, h_ptr, stride_h, nw_ptr, res_ptr,
                                    normed_ptr, K, rstd, ms, m_ok, k0, k_hi, stored_rows, NORM,
                                    HAS_H, BK), acc)
        mask = m_ok[:, None] & row_ok[None, :]
        offs = ms.to(tl.int64)[:, None] * N + rows[None, :]
        last, total = sum_parts(tl.trans(acc), part, tl.num_programs(1), part_ptr, offs, M * N,
                                mask, counter_ptr + tile, _PARTS_IN_FLIGHT)
        if last:
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
        return last, rstd

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, part_ptr, counter_ptr, out_ptr, xo_ptr, inv_ptr,
                       xsum_ptr, h_ptr, nw_ptr, res_ptr, normed_ptr, stride_h, eps, M, N, K,
                       stride_x, stride_w, split_len, OPERAND: tl.constexpr,
                       GROUP: tl.constexpr, HAS_SUM: tl.constexpr, NORM: tl.constexpr,
                       HAS_H: tl.constexpr, NORM_ROWS: tl.constexpr, NORM_BD: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GDC: tl.constexpr):
        """`skinny_part`; with OPERAND, the first programs then write x's decode operand
        (`write_operand`)."""
        _, rstd = skinny_part(x_ptr, w_ptr, part_ptr, counter_ptr, out_ptr, h_ptr, nw_ptr,
                              res_ptr, normed_ptr, stride_h, eps, M, N, K, stride_x, stride_w,
                              split_len, NORM, HAS_H, NORM_ROWS, NORM_BD, BM, BN, BK, GDC)
        if OPERAND:
            write_operand(x_ptr, stride_x, h_ptr, stride_h, nw_ptr, rstd, M, K, xo_ptr,
                          inv_ptr, xsum_ptr, BM, GROUP, HAS_SUM, NORM, HAS_H)
