"""Partial NeoX-style rotary embedding over the first `rotary_dim` dims of each head.

Qwen3.5 uses interleaved mRoPE (t, h, w position components); for text all three components
are equal and it reduces to this ordinary 1-D RoPE. Vision positions need the mRoPE section map
and are not handled here.

Full attention normalises q and k per head (q_norm / k_norm, zero-centred) right before the
rotation, so `qk_norm_rope` does both for q and k in one kernel launch: each (token, head) row is
read once and written once. The kernel rotates with the step's cos/sin tables (`rope_cos_sin`,
built once per step and shared by every layer) rather than computing them itself, so it agrees
with the reference to fp32 rounding.
"""

from __future__ import annotations

import torch

from ninfer_runtime.ops.dispatch import use_triton
from ninfer_runtime.ops.norm import check_rows, rms_norm_ref, row_tile

try:
    import triton
    import triton.language as tl

    from ninfer_runtime.ops.norm import inv_rms, row_offsets
except ImportError:  # CPU-only install: the references still run
    triton = None


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int,
                 theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [T, rotary_dim] (fp32) for integer `positions` [T]."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (exponent / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] over dims [0, rotary_dim); the rest passes through."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    out = rot * cos + rotated_half * sin
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope(rms_norm(q, q_weight)) and the same for k: q [T, nq, hd], k [T, nkv, hd]."""
    return (apply_rope(rms_norm_ref(q, q_weight, eps), cos, sin),
            apply_rope(rms_norm_ref(k, k_weight, eps), cos, sin))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm per head, then partial RoPE, of q [T, nq, hd] and k [T, nkv, hd]
    (views with a contiguous last dim) -> contiguous q, k (see `qk_norm_rope_ref`)."""
    if not use_triton(q, k, q_weight, k_weight, cos, sin):
        return qk_norm_rope_ref(q, k, q_weight, k_weight, cos, sin, eps)
    return _launch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)


if triton is not None:

    @triton.jit
    def _norm_rope_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, block, n_rows, heads,
                        stride_t, stride_h, eps, HD: tl.constexpr, ROT: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
        """Rows block*BLOCK_R.. of one [T, heads, HD] view: norm, round, rotate, round.

        The whole row is loaded for the statistics and the pass-through dims; the two rotary
        halves [0, ROT/2) and [ROT/2, ROT) are loaded again as their own tiles (cache hits) so
        that the rotation pairs them elementwise, with no gather across lanes.
        """
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        cols = tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (cols < HD)[None, :]
        src = x_ptr + row_offsets(rows, heads, stride_t, stride_h)[:, None]
        dst = out_ptr + rows.to(tl.int64)[:, None] * HD
        dtype = out_ptr.dtype.element_ty
        x = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = inv_rms(x, HD, eps)[:, None]
        w = tl.load(w_ptr + cols, mask=cols < HD, other=0.0).to(tl.float32)
        y = x * r * (1.0 + w)[None, :]
        tl.store(dst + cols[None, :], y.to(dtype), mask=mask & (cols >= ROT)[None, :])

        half = ROT // 2
        hcols = tl.arange(0, BLOCK_H)
        hmask = row_ok[:, None] & (hcols < half)[None, :]
        x1 = tl.load(src + hcols[None, :], mask=hmask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + hcols[None, :], mask=hmask, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + hcols, mask=hcols < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + hcols, mask=hcols < half, other=0.0).to(tl.float32)
        y1 = (x1 * r * (1.0 + w1)[None, :]).to(dtype).to(tl.float32)  # the rounded norm
        y2 = (x2 * r * (1.0 + w2)[None, :]).to(dtype).to(tl.float32)
        table = (rows // heads).to(tl.int64)[:, None] * ROT + hcols[None, :]
        cos1 = tl.load(cos_ptr + table, mask=hmask, other=0.0)
        sin1 = tl.load(sin_ptr + table, mask=hmask, other=0.0)
        cos2 = tl.load(cos_ptr + half + table, mask=hmask, other=0.0)
        sin2 = tl.load(sin_ptr + half + table, mask=hmask, other=0.0)
        tl.store(dst + hcols[None, :], (y1 * cos1 - y2 * sin1).to(dtype), mask=hmask)
        tl.store(dst + half + hcols[None, :], (y2 * cos2 + y1 * sin2).to(dtype), mask=hmask)

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out, k_out,
                             n_tokens, nq, nkv, q_st, q_sh, k_st, k_sh, q_blocks, eps,
                             HD: tl.constexpr, ROT: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
        """The first q_blocks programs take q's rows, the rest k's."""
        pid = tl.program_id(0)
        if pid < q_blocks:
            _norm_rope_rows(q_ptr, qw_ptr, cos_ptr, sin_ptr, q_out, pid, n_tokens * nq, nq,
                            q_st, q_sh, eps, HD, ROT, BLOCK_R, BLOCK_D, BLOCK_H)
        else:
            _norm_rope_rows(k_ptr, kw_ptr, cos_ptr, sin_ptr, k_out, pid - q_blocks,
                            n_tokens * nkv, nkv, k_st, k_sh, eps, HD, ROT, BLOCK_R, BLOCK_D,
                            BLOCK_H)


def _launch_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                         k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_rows("qk_norm_rope q", q)
    check_rows("qk_norm_rope k", k)
    t, nq, hd = q.shape
    nkv = k.shape[1]
    rot = cos.shape[-1]
    assert k.shape == (t, nkv, hd) and k.dtype == q.dtype, f"qk_norm_rope k {k.shape} {k.dtype}"
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        assert w.shape == (hd,) and w.is_contiguous(), f"qk_norm_rope {name} {w.shape}"
    for name, table in (("cos", cos), ("sin", sin)):
        assert table.shape == (t, rot) and table.dtype == torch.float32 and \
            table.is_contiguous(), f"qk_norm_rope {name} {table.shape} {table.dtype}"
    assert rot % 2 == 0 and 0 < rot <= hd, f"qk_norm_rope rotary_dim {rot} for head_dim {hd}"
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    # One tile shape for both: a q block and a k block cost the same.
    block_r, block_d, num_warps = row_tile(t * nkv, hd)
    q_blocks = triton.cdiv(t * nq, block_r)
    grid = (q_blocks + triton.cdiv(t * nkv, block_r),)
    _qk_norm_rope_kernel[grid](
        q, k, q_weight, k_weight, cos, sin, q_out, k_out, t, nq, nkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_blocks, eps,
        HD=hd, ROT=rot, BLOCK_R=block_r, BLOCK_D=block_d,
        BLOCK_H=triton.next_power_of_2(rot // 2), num_warps=num_warps)
    return q_out, k_out
