"""RMSNorm variants: Qwen3.5's zero-centred (1 + w) everywhere in the target, plain w in the GDN
gated norm and, with `unit_offset=False`, in the Qwen3-style DFlash draft.

Each op has a torch reference (`*_ref`: the oracle, and what runs on CPU) and a Triton kernel;
the public function picks one per call (ops.dispatch). The kernels do what the references do,
rounding included: fp32 math, each intermediate the reference rounds to x.dtype rounded at the
same point, so the two differ only in how the squares are summed (the kernels: in fp64,
`rms_math.inv_rms`).

A kernel program normalises a tile of rows [BLOCK_R, BLOCK_D]: one long row at H = 5120, many
128-wide head rows in the GDN norm, so that every program moves a few KB and decode (a handful
of rows) still spreads over several programs. Rows are addressed as (token, head) with separate
strides, so head views cut out of a fused projection output are read in place, not copied.

The GDN output norm of a decode step also writes the activation operand of the out_proj
GEMV that reads it (`gated_rms_norm_with_operand`, models.layers.gated_norm): the bits the
GEMV's own activation pass would make, one launch fewer a GDN layer (the twelfth run, docs/
perf.md: 48 a 27B step, +2.1 tok/s). The input and post-attention RMSNorms wrote their
projections' operands too until that run timed them: they cost the 27B 2.3 tok/s, the
operand's group maxima and scattered stores serial inside a norm where the GEMV's own pass
spreads them over programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer_runtime.ops.dispatch import use_triton
from ninfer_runtime.ops.launch import options
from ninfer_runtime.ops.quant_linear import DecodeOperand, operand_buffers

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the references still run
    triton = None


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _scale(weight: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    return 1.0 + weight.float() if unit_offset else weight.float()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 unit_offset: bool = True) -> torch.Tensor:
    """x / rms(x) * (1 + w) over the last dim, in fp32, cast back to x.dtype.

    Qwen3.5 stores these weights zero-centred (initialised to 0), so the scale is 1 + w;
    `unit_offset=False` scales by w itself (Qwen3 RMSNorm, as the DFlash draft uses).
    """
    return (_normalize(x, eps) * _scale(weight, unit_offset)).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + h, rms_norm(x + h)), the sum in x.dtype."""
    x = x + h
    return x, rms_norm_ref(x, weight, eps, unit_offset=unit_offset)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """The GDN output norm: (w * x / rms(x)) * silu(z) over the last dim (norm before gate).

    Unlike `rms_norm` the weight is plain (initialised to 1). The normalised x is rounded to
    x.dtype before the weight multiply, as the reference implementation does.
    """
    normed = weight * _normalize(x, eps).to(x.dtype)
    return (normed * F.silu(z.float())).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             unit_offset: bool = True) -> torch.Tensor:
    """x / rms(x) * (1 + w) over the last dim of x [..., D]; * w with `unit_offset=False`
    (see `rms_norm_ref`)."""
    if not use_triton(x, weight):
        return rms_norm_ref(x, weight, eps, unit_offset=unit_offset)
    return _launch_rms_norm(_rows(x), None, weight, eps, unit_offset)[1].view(x.shape)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h, weight)) in one pass over x [..., D] and h (same shape): the
    residual stream update and the norm that reads it (see `add_rms_norm_ref`)."""
    if not use_triton(x, h, weight):
        return add_rms_norm_ref(x, h, weight, eps, unit_offset=unit_offset)
    if x.shape != h.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and h {tuple(h.shape)} differ")
    residual, out = _launch_rms_norm(_rows(x), _rows(h), weight, eps, unit_offset)
    return residual.view(x.shape), out.view(x.shape)


@dataclass(frozen=True)
class DeferredNorm:
    """`add_rms_norm(x, h, weight, eps)` of a decode step's rows (`rms_norm(x, weight, eps)`
    with h None), its outputs allocated but not yet written: `residual` (x + h; x itself
    with h None) and `out`. The op that first reads `out` runs it, in its own launch where
    it can (the prologue of ops.skinny_linear's kernels, GDN's in_proj_ba and the MoE router;
    the decode GEMV's activation pass, ops.quant_linear.activation_operands), else by `run`:
    a decode step's norm kernel is one program, whose launch costs more than its work
    (~1.1 us a norm in a 27B graph, docs/perf.md, thirty-first run)."""

    x: torch.Tensor
    h: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor
    out: torch.Tensor

    def run(self) -> None:
        """Write residual and out by the norm kernel."""
        _launch_rms_norm(_rows(self.x), None if self.h is None else _rows(self.h), self.weight,
                         self.eps, True, None if self.h is None else _rows(self.residual),
                         _rows(self.out))


def run_deferred(norm: DeferredNorm | None) -> None:
    """Run `norm`, where there is one (its reader's launch cannot)."""
    if norm is not None:
        norm.run()


def defer_add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> DeferredNorm | None:
    """The `DeferredNorm` of x [M, H] (+ h) where the Triton kernels run it; else None."""
    if x.dim() != 2 or not use_triton(x, weight, *([] if h is None else [h])):
        return None
    if h is not None and (h.shape != x.shape or h.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, h {tuple(h.shape)} "
                         f"{h.dtype}")
    residual = x if h is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    return DeferredNorm(x, h, weight, eps, residual,
                        torch.empty_like(x, memory_format=torch.contiguous_format))


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """(w * x / rms(x)) * silu(z) over the last dim of x, z [..., D] (see
    `gated_rms_norm_ref`)."""
    if not use_triton(x, z, weight):
        return gated_rms_norm_ref(x, z, weight, eps)
    if x.shape != z.shape:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and z {tuple(z.shape)} differ")
    return _launch_gated_rms_norm(_rows(x), _rows(z), weight, eps)[0].view(x.shape)


def gated_rms_norm_with_operand(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                                eps: float, group: int, sums: bool
                                ) -> tuple[torch.Tensor, DecodeOperand | None]:
    """`gated_rms_norm` over x, z [T, heads, D] that also writes the decode operand of its
    output read as [T, heads * D] (the GDN out_proj's input; quant_linear.DecodeOperand:
    scaled in groups of `group` inputs, with the groups' sums if `sums`), the bits that
    GEMV's own activation pass would make, where a program's heads make whole operand
    groups: D a power of two and heads a multiple of group / D. Elsewhere the operand is
    None (the GEMV makes its own). Triton only: a decode step's few rows on the GPU."""
    if x.dim() != 3 or z.shape != x.shape:
        raise ValueError(f"gated_rms_norm_with_operand: x {tuple(x.shape)}, z {tuple(z.shape)}")
    fits = operand_heads(x.shape[1], x.shape[2], group) is not None
    return _launch_gated_rms_norm(x, z, weight, eps, (group, sums) if fits else None)


def operand_heads(heads: int, d: int, group: int) -> int | None:
    """Heads of D inputs that one gated-norm program takes to write whole decode operand groups
    of `group` inputs (`gated_norm_rows`), or None where the heads cannot make them: D a power
    of two and heads a multiple of group / D."""
    per = max(1, group // d)
    return per if (d & (d - 1)) == 0 and heads % per == 0 else None


def rounds_product(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """`gated_norm_rows`'s ROUND_PRODUCT: whether the reference's w * normed product is in
    x.dtype (w in it) rather than fp32."""
    product = torch.promote_types(weight.dtype, x.dtype)
    assert product in (x.dtype, torch.float32), f"gated_rms_norm weight dtype {weight.dtype}"
    return product == x.dtype


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as a [T, heads, D] view (a copy only when no such view exists)."""
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x[:, None, :]
    return x.reshape(-1, 1, x.shape[-1])


def row_tile(n_rows: int, d: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a row kernel over n_rows rows of d elements.

    About 4K elements per program (16 per thread: two 16-byte loads of bf16), fewer rows when
    there are few, so that decode still gets several programs; a long row gets one program of
    up to 16 warps. A fixed rule rather than autotuning: these kernels are memory-bound and the
    row counts vary every step, which would re-tune at serving time.
    """
    block_d = triton.next_power_of_2(d)
    spread = triton.next_power_of_2(triton.cdiv(n_rows, 64))  # rows that keep ~64 programs
    block_r = max(1, min(4096 // block_d, spread))
    num_warps = max(1, min(16, block_r * block_d // 512))
    return block_r, block_d, num_warps


def check_rows(name: str, t: torch.Tensor) -> None:
    """Launcher precondition: a [T, heads, D] view with unit stride along D."""
    assert t.dim() == 3 and t.stride(2) == 1, \
        f"{name}: need [T, heads, D] with contiguous D, got {tuple(t.shape)} {t.stride()}"


if triton is not None:
    from ninfer_runtime.ops.launch import wait_for_inputs
    from ninfer_runtime.ops.quant_decode import store_operand
    from ninfer_runtime.ops.rms_math import inv_rms, normed, residual

    @triton.jit
    def row_offsets(rows, heads, stride_t, stride_h):
        """Element offset of each flat row (token * heads + head) of a [T, heads, D] view."""
        token, head = rows // heads, rows % heads
        return token.to(tl.int64) * stride_t + head.to(tl.int64) * stride_h

    # n_rows changes from step to step and only bounds the rows: no variant per value class
    # (== 1, divisible by 16, other), so the start-up compiles one where it compiled three
    @triton.jit(do_not_specialize=["n_rows"])
    def _rms_norm_kernel(x_ptr, h_ptr, res_ptr, w_ptr, out_ptr, n_rows, heads,
                         x_st, x_sh, h_st, h_sh, eps, D: tl.constexpr,
                         HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, GDC: tl.constexpr):
        wait_for_inputs(GDC)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
        dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
        r = residual(x_ptr + row_offsets(rows, heads, x_st, x_sh)[:, None] + cols[None, :],
                     h_ptr + row_offsets(rows, heads, h_st, h_sh)[:, None] + cols[None, :],
                     mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(res_ptr + dst, r, mask=mask)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        y = normed(r, inv_rms(r.to(tl.float32), D, eps)[:, None], w[None, :], UNIT_OFFSET)
        tl.store(out_ptr + dst, y, mask=mask)

    # not inlined: in the GDN decode kernel's epilogue (ops.gdn), inlined, its operand code
    # took that kernel from 168 to 210 registers a thread at BV 16 (sm_90, Triton 3.6): 2
    # programs an SM instead of 3; as a call it stays at 168
    @triton.jit(noinline=True)
    def gated_norm_rows(x_ptr, z_ptr, w_ptr, out_ptr, xo_ptr, inv_ptr, xsum_ptr, first, n_rows,
                        heads, x_st, x_sh, z_st, z_sh, eps, D: tl.constexpr,
                        ROUND_PRODUCT: tl.constexpr, OPERAND: tl.constexpr,
                        OPERAND_SUMS: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
        """Rows first .. first + BLOCK_R (token * heads + head) of the gated norm of x, z [T,
        heads, D] views into out [T, heads, D]. OPERAND (a group size, 0 for none): the
        decode operand of the output read as [tokens, heads * D] too; the BLOCK_R heads are
        then whole groups of one token (BLOCK_D = D, heads a multiple of BLOCK_R). CACHE: the
        loads' cache modifier (".cg" where other programs of the launch wrote x)."""
        rows = first + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row_offsets(rows, heads, x_st, x_sh)[:, None] + cols[None, :],
                    mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
        z = tl.load(z_ptr + row_offsets(rows, heads, z_st, z_sh)[:, None] + cols[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        normed = (x * inv_rms(x, D, eps)[:, None]).to(dtype).to(tl.float32)
        y = w[None, :] * normed
        if ROUND_PRODUCT:  # w and x share a dtype: the reference's product is in it
            y = y.to(dtype).to(tl.float32)
        y = (y * (z / (1.0 + tl.exp(-z)))).to(dtype)
        dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(out_ptr + dst, y, mask=mask)
        if OPERAND:  # from the stored values, as the GEMV's activation pass would read them
            tokens = first // heads + tl.arange(0, 1)
            flat = tl.reshape(y.to(tl.float32), (1, BLOCK_R * BLOCK_D))
            store_operand(flat, tokens, tokens < n_rows // heads, (first % heads) * D,
                          n_rows // heads, heads * D, xo_ptr, inv_ptr, xsum_ptr, OPERAND,
                          OPERAND_SUMS)

    @triton.jit(do_not_specialize=["n_rows"])  # as _rms_norm_kernel
    def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, xo_ptr, inv_ptr, xsum_ptr, n_rows,
                               heads, x_st, x_sh, z_st, z_sh, eps, D: tl.constexpr,
                               ROUND_PRODUCT: tl.constexpr, OPERAND: tl.constexpr,
                               OPERAND_SUMS: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_D: tl.constexpr, GDC: tl.constexpr):
        """Rows block program_id(0) (`gated_norm_rows`)."""
        wait_for_inputs(GDC)
        gated_norm_rows(x_ptr, z_ptr, w_ptr, out_ptr, xo_ptr, inv_ptr, xsum_ptr,
                        tl.program_id(0) * BLOCK_R, n_rows, heads, x_st, x_sh, z_st, z_sh, eps,
                        D, ROUND_PRODUCT, OPERAND, OPERAND_SUMS, BLOCK_R, BLOCK_D, "")


def _launch_rms_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, unit_offset: bool, residual: torch.Tensor | None = None,
                     out: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """x, h [T, heads, D] views -> (x + h or None, normed), both contiguous [T, heads, D]
    (into `residual` and `out` where given)."""
    check_rows("rms_norm x", x)
    t, heads, d = x.shape
    assert weight.shape == (d,) and weight.is_contiguous(), f"rms_norm weight {weight.shape}"
    if h is not None:
        check_rows("add_rms_norm h", h)
        assert h.shape == x.shape and h.dtype == x.dtype, f"add_rms_norm h {h.shape} {h.dtype}"
        if residual is None:
            residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert all(t is None or (t.shape == x.shape and t.is_contiguous())
               for t in (residual, out)), "rms_norm: contiguous outputs of x's shape"
    n_rows = t * heads
    if n_rows == 0:
        return residual, out
    block_r, block_d, num_warps = row_tile(n_rows, d)
    h_strides = (h.stride(0), h.stride(1)) if h is not None else (0, 0)
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x, h if h is not None else x, residual if residual is not None else out, weight, out,
        n_rows, heads, x.stride(0), x.stride(1), *h_strides, eps, D=d,
        HAS_RESIDUAL=h is not None, UNIT_OFFSET=unit_offset, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=num_warps, **options(x.device))
    return residual, out


def _launch_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                           eps: float, operand: tuple[int, bool] | None = None
                           ) -> tuple[torch.Tensor, DecodeOperand | None]:
    """x, z [T, heads, D] views -> (contiguous [T, heads, D] in x.dtype, with `operand` =
    (group, sums) its decode operand as [T, heads * D])."""
    check_rows("gated_rms_norm x", x)
    check_rows("gated_rms_norm z", z)
    t, heads, d = x.shape
    assert z.shape == x.shape, f"gated_rms_norm z {z.shape} vs x {x.shape}"
    assert weight.shape == (d,) and weight.is_contiguous(), f"gated_rms_norm weight {weight.shape}"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = t * heads
    group, sums = operand or (0, False)
    decode = None
    if operand is not None:
        decode = DecodeOperand.empty(t, heads * d, group, sums, x.device)
    if n_rows == 0:
        return out, decode
    block_r, block_d, num_warps = row_tile(n_rows, d)
    if operand is not None:  # the heads of whole operand groups
        block_r = max(1, group // d)
        assert block_d == d and heads % block_r == 0, f"a decode operand of {tuple(x.shape)}"
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x, z, weight, out, *operand_buffers(decode, out),
        n_rows, heads, x.stride(0), x.stride(1), z.stride(0), z.stride(1), eps, D=d,
        ROUND_PRODUCT=rounds_product(weight, x), OPERAND=group, OPERAND_SUMS=sums, BLOCK_R=block_r,
        BLOCK_D=block_d, num_warps=num_warps, **options(x.device))
    return out, decode
