"""Partial NeoX-style rotary embedding over the first `rotary_dim` dims of each head.

Qwen3.5 uses interleaved mRoPE (t, h, w position components); for text all three components
are equal and it reduces to this ordinary 1-D RoPE. Vision positions need the mRoPE section map
and are not handled here. The DFlash draft rotates the whole head with its own theta and, for
some releases, YaRN scaling (`rope_cos_sin(..., scaling=...)`, Hugging Face's definitions).

Full attention normalises q and k per head (q_norm / k_norm, zero-centred) right before the
rotation, so `qk_norm_rope` does both for q and k in one kernel launch: each (token, head) row is
read once and written once. The kernel rotates with the step's cos/sin tables (`rope_cos_sin`,
built once per step and shared by every layer) rather than computing them itself, so it agrees
with the reference to fp32 rounding. `qk_norm_rope_store` also writes the rotated keys and the
values into the paged KV caches in that launch (a program then takes whole tokens' keys, reads
them back after a barrier and stores them as ops.attention.store_kv does): one launch fewer
per attention layer and step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ninfer_runtime.config import ROPE_TYPES
from ninfer_runtime.ops.attention import KVStore, store_args, store_constexprs
from ninfer_runtime.ops.dispatch import use_triton
from ninfer_runtime.ops.launch import options
from ninfer_runtime.ops.norm import check_rows, rms_norm_ref, row_tile

try:
    import triton
    import triton.language as tl

    from ninfer_runtime.ops.norm import row_offsets
    from ninfer_runtime.ops.rms_math import inv_rms
except ImportError:  # CPU-only install: the references still run
    triton = None


def rope_inv_freq(rotary_dim: int, theta: float, scaling: Mapping[str, Any] | None = None,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] (fp32) and the factor cos and sin are scaled by.

    `scaling` is a Hugging Face rope_parameters / rope_scaling dict: rope_type "default",
    "linear" (factor) or "yarn" (factor, original_max_position_embeddings, beta_fast,
    beta_slow, attention_factor or mscale / mscale_all_dim, truncate), computed as
    transformers' `_compute_yarn_parameters` does.
    """
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    pos_freqs = theta ** exponent
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind == "linear":
        return 1.0 / (pos_freqs * float(scaling["factor"])), 1.0
    if kind != "yarn":
        raise ValueError(f"rope_type {kind!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    factor = float(scaling["factor"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        """The dim whose wavelength makes `rotations` turns over the original context."""
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = correction_dim(float(scaling.get("beta_fast") or 32))
    high = correction_dim(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 for the high-frequency dims, which keep their frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                 scaling: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [T, rotary_dim] (fp32) for integer `positions` [T]; `scaling` as for
    `rope_inv_freq`. A decode step makes them in three launches (the angles, cos, sin): the
    frequencies, duplicated for the two rotary halves, are made once per device."""
    inv_freq, factor = _doubled_inv_freq(rotary_dim, theta, scaling, positions.device)
    angles = positions[:, None] * inv_freq[None, :]  # the position's fp32 cast in the multiply
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


_INV_FREQS: dict[tuple, tuple[torch.Tensor, float]] = {}


def _doubled_inv_freq(rotary_dim: int, theta: float, scaling: Mapping[str, Any] | None,
                      device: torch.device) -> tuple[torch.Tensor, float]:
    """`rope_inv_freq` twice over [rotary_dim] and its factor, made once per arguments (not
    kept when made inside a CUDA graph capture, whose kernels run only at a replay)."""
    key = (rotary_dim, theta, repr(sorted((scaling or {}).items())), device)
    if key in _INV_FREQS:
        return _INV_FREQS[key]
    inv_freq, factor = rope_inv_freq(rotary_dim, theta, scaling, device)
    made = torch.cat([inv_freq, inv_freq]), factor
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _INV_FREQS[key] = made
    return made


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] over dims [0, rotary_dim); the rest passes through."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    out = rot * cos + rotated_half * sin
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float, *, unit_offset: bool = True) -> torch.Tensor:
    """apply_rope(rms_norm(x, weight)) for x [T, heads, hd]."""
    return apply_rope(rms_norm_ref(x, weight, eps, unit_offset=unit_offset), cos, sin)


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                     *, unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope(rms_norm(q, q_weight)) and the same for k: q [T, nq, hd], k [T, nkv, hd]."""
    return (norm_rope_ref(q, q_weight, cos, sin, eps, unit_offset=unit_offset),
            norm_rope_ref(k, k_weight, cos, sin, eps, unit_offset=unit_offset))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, *,
                 unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm per head (zero-centred; plain w with `unit_offset=False`), then partial RoPE,
    of q [T, nq, hd] and k [T, nkv, hd] (views with a contiguous last dim) -> contiguous q, k
    (see `qk_norm_rope_ref`)."""
    if not use_triton(q, k, q_weight, k_weight, cos, sin):
        return qk_norm_rope_ref(q, k, q_weight, k_weight, cos, sin, eps, unit_offset=unit_offset)
    return _launch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, unit_offset)


def qk_norm_rope_store(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, eps: float, store: KVStore, *,
                       unit_offset: bool = True) -> torch.Tensor | None:
    """`qk_norm_rope` (without q, of k alone), the rotated k and v [T, nkv, hd] then written
    into the caches as `store.write` does, in one launch where the shapes allow (a power-of-two
    nkv). Returns q's rows (None without q)."""
    tensors = [t for t in (q, k, v, q_weight, k_weight, cos, sin) if t is not None]
    fused = use_triton(*tensors) and k.shape[1] == triton.next_power_of_2(k.shape[1]) \
        and k.shape[2] == triton.next_power_of_2(k.shape[2])
    if fused:
        return _launch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, unit_offset,
                                    (v, store))[0]
    if q is None:
        q_out, k_out = None, norm_rope(k, k_weight, cos, sin, eps, unit_offset=unit_offset)
    else:
        q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps,
                                    unit_offset=unit_offset)
    store.write(k_out, v)
    return q_out


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              eps: float, *, unit_offset: bool = True) -> torch.Tensor:
    """`qk_norm_rope` for one tensor x [T, heads, hd]: the keys of the DFlash draft's context,
    which have no queries."""
    if not use_triton(x, weight, cos, sin):
        return norm_rope_ref(x, weight, cos, sin, eps, unit_offset=unit_offset)
    return _launch_qk_norm_rope(None, x, None, weight, cos, sin, eps, unit_offset)[1]


if triton is not None:
    from ninfer_runtime.ops.attention import store_token
    from ninfer_runtime.ops.launch import wait_for_inputs

    @triton.jit
    def _norm_rope_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, block, n_rows, heads,
                        stride_t, stride_h, eps, HD: tl.constexpr, ROT: tl.constexpr,
                        UNIT_OFFSET: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
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
        if UNIT_OFFSET:
            w = 1.0 + w
        y = x * r * w[None, :]
        tl.store(dst + cols[None, :], y.to(dtype), mask=mask & (cols >= ROT)[None, :])

        half = ROT // 2
        hcols = tl.arange(0, BLOCK_H)
        hmask = row_ok[:, None] & (hcols < half)[None, :]
        x1 = tl.load(src + hcols[None, :], mask=hmask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + hcols[None, :], mask=hmask, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + hcols, mask=hcols < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + hcols, mask=hcols < half, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            w1 = 1.0 + w1
            w2 = 1.0 + w2
        y1 = (x1 * r * w1[None, :]).to(dtype).to(tl.float32)  # the rounded norm
        y2 = (x2 * r * w2[None, :]).to(dtype).to(tl.float32)
        table = (rows // heads).to(tl.int64)[:, None] * ROT + hcols[None, :]
        cos1 = tl.load(cos_ptr + table, mask=hmask, other=0.0)
        sin1 = tl.load(sin_ptr + table, mask=hmask, other=0.0)
        cos2 = tl.load(cos_ptr + half + table, mask=hmask, other=0.0)
        sin2 = tl.load(sin_ptr + half + table, mask=hmask, other=0.0)
        tl.store(dst + hcols[None, :], (y1 * cos1 - y2 * sin1).to(dtype), mask=hmask)
        tl.store(dst + half + hcols[None, :], (y2 * cos2 + y1 * sin2).to(dtype), mask=hmask)

    # the token and block counts change from step to step and only bound the rows: one variant
    # where their value classes (== 1, divisible by 16, other) made up to nine
    @triton.jit(do_not_specialize=["n_tokens", "q_blocks"])
    def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out, k_out,
                             v_ptr, v_st, v_sh, k_cache, v_cache, k_scale, v_scale,
                             slot_mapping, n_tokens, nq, nkv, q_st, q_sh, k_st, k_sh, q_blocks,
                             eps, HD: tl.constexpr, ROT: tl.constexpr,
                             UNIT_OFFSET: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                             STORE: tl.constexpr, HEADS: tl.constexpr, GROUPS: tl.constexpr,
                             GROUP: tl.constexpr, QUANT: tl.constexpr, GDC: tl.constexpr):
        """The first q_blocks programs take q's rows, the rest k's. With STORE a k block is
        whole tokens (BLOCK_R a multiple of HEADS = nkv), whose rows the program reads back
        once every thread has stored them, into the caches with the tokens' v rows."""
        wait_for_inputs(GDC)
        pid = tl.program_id(0)
        if pid < q_blocks:
            _norm_rope_rows(q_ptr, qw_ptr, cos_ptr, sin_ptr, q_out, pid, n_tokens * nq, nq,
                            q_st, q_sh, eps, HD, ROT, UNIT_OFFSET, BLOCK_R, BLOCK_D, BLOCK_H)
        else:
            block = pid - q_blocks
            _norm_rope_rows(k_ptr, kw_ptr, cos_ptr, sin_ptr, k_out, block,
                            n_tokens * nkv, nkv, k_st, k_sh, eps, HD, ROT, UNIT_OFFSET,
                            BLOCK_R, BLOCK_D, BLOCK_H)
            if STORE:
                tl.debug_barrier()  # other threads stored some of the rows read back here
                for i in tl.static_range(BLOCK_R // HEADS):
                    t = (block * (BLOCK_R // HEADS) + i).to(tl.int64)
                    slot = tl.load(slot_mapping + t, mask=t < n_tokens, other=-1)
                    if slot >= 0:  # negative: a captured graph's padding row
                        store_token(k_out, nkv * HD, HD, k_cache, k_scale, slot, t, nkv, HEADS,
                                   GROUPS, GROUP, QUANT)
                        store_token(v_ptr, v_st, v_sh, v_cache, v_scale, slot, t, nkv, HEADS,
                                   GROUPS, GROUP, QUANT)


def _launch_qk_norm_rope(q: torch.Tensor | None, k: torch.Tensor, q_weight: torch.Tensor | None,
                         k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         eps: float, unit_offset: bool,
                         store: tuple[torch.Tensor, KVStore] | None = None
                         ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """q, k -> (q_out, k_out); without q (and q_weight) only k's rows are launched. With
    `store` (v and where it goes), k_out and v are written into the caches too."""
    check_rows("qk_norm_rope k", k)
    t, nkv, hd = k.shape
    rot = cos.shape[-1]
    nq = 0
    if q is not None:
        check_rows("qk_norm_rope q", q)
        nq = q.shape[1]
        assert q.shape == (t, nq, hd) and k.dtype == q.dtype, \
            f"qk_norm_rope q {q.shape} {q.dtype} vs k {k.shape} {k.dtype}"
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        assert w is None or (w.shape == (hd,) and w.is_contiguous()), \
            f"qk_norm_rope {name} {w.shape}"
    for name, table in (("cos", cos), ("sin", sin)):
        assert table.shape == (t, rot) and table.dtype == torch.float32 and \
            table.is_contiguous(), f"qk_norm_rope {name} {table.shape} {table.dtype}"
    assert rot % 2 == 0 and 0 < rot <= hd, f"qk_norm_rope rotary_dim {rot} for head_dim {hd}"
    q_out = None if q is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    # One tile shape for both: a q block and a k block cost the same.
    block_r, block_d, num_warps = row_tile(t * nkv, hd)
    if store is None:  # placeholders for the unused store arguments
        v, caches, stored = k, (k_out,) * 5, {"STORE": False, "HEADS": 1, "GROUPS": 1,
                                              "GROUP": 1, "QUANT": False}
    else:
        v, kv = store
        caches, stored = store_args(k_out, v, kv), {"STORE": True, **store_constexprs(k, kv)}
        block_r = max(block_r, stored["HEADS"])  # whole tokens (both powers of two)
        num_warps = max(num_warps, min(16, block_r * block_d // 512))
    q_blocks = triton.cdiv(t * nq, block_r)
    grid = (q_blocks + triton.cdiv(t * nkv, block_r),)
    q_args = (k, k_weight, k_out, 0, 0) if q is None else (q, q_weight, q_out, *q.stride()[:2])
    _qk_norm_rope_kernel[grid](
        q_args[0], k, q_args[1], k_weight, cos, sin, q_args[2], k_out, v, v.stride(0),
        v.stride(1), *caches, t, nq, nkv, q_args[3], q_args[4], k.stride(0), k.stride(1),
        q_blocks, eps, HD=hd, ROT=rot, UNIT_OFFSET=unit_offset, BLOCK_R=block_r,
        BLOCK_D=block_d, BLOCK_H=triton.next_power_of_2(rot // 2), **stored,
        num_warps=num_warps, **options(k.device))
    return q_out, k_out
