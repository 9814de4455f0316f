"""NVFP4 weight quantizer, byte-exact with ModelOpt's `NVFP4QTensor.quantize` (modelopt 0.47).

For each source matrix M [out, in] (every expert of a 3-D stack [E, out, in] is its own matrix,
as ModelOpt quantizes each expert's Linear separately):

    g = amax(|M|) / (6 * 448)                                   fp32, stored as weight_scale_2
    s = e4m3(clamp(amax(|block|) / (6 * g), 2**-9, 448))        per 16 inputs; a zero block gets 1
    q = e2m1(block / (float(s) * g))                            round to nearest, ties to even code

Byte-exactness comes from repeating ModelOpt's fp32 expressions operand for operand. That
includes `amax / 2688` with a Python scalar, which PyTorch's CUDA kernel computes as a multiply
by the reciprocal: g's last bit then differs from CPU for about 1 tensor in 4, so on either
device the bytes match ModelOpt run on that same device, and a CPU and a GPU conversion of one
checkpoint need not be byte-identical to each other. One deliberate deviation:
an all-zero matrix, where ModelOpt divides 0 by 0 and emits NaN scales, is quantized as if its
amax were 1, giving zero codes and finite scales.
"""

from __future__ import annotations

import torch

from ninfer_convert.quantize.chunking import CHUNK_ELEMS, row_slices
from ninfer_runtime.quant.nvfp4 import BLOCK, E2M1_MAX, E4M3_MAX, stored_specs
from ninfer_runtime.quant.packing import pack_nibbles

# Midpoints between neighbouring E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, split by the way a
# tie rounds: towards the neighbour whose code is even (its mantissa bit is 0).
_TIES_ROUND_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIES_ROUND_UP = (0.75, 1.75, 3.5)
_MIN_BLOCK_SCALE = 2.0**-9  # the smallest positive e4m3 value (a subnormal)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> uint8 E2M1 codes (bit 3 = sign), round to nearest even, saturating above 6."""
    magnitude = x.abs()
    down = torch.tensor(_TIES_ROUND_DOWN, dtype=x.dtype, device=x.device)
    up = torch.tensor(_TIES_ROUND_UP, dtype=x.dtype, device=x.device)
    # The code is the number of midpoints the magnitude has passed: strictly for ties that
    # round down, inclusively for ties that round up.
    code = torch.bucketize(magnitude, down, out_int32=True)
    code += torch.bucketize(magnitude, up, out_int32=True, right=True)
    return code.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)


def _abs_max(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """max |x| over dim without materialising |x| (ModelOpt's reduce_amax)."""
    return torch.maximum(x.amax(dim=dim).abs(), x.amin(dim=dim).abs())


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """fp32 g per source matrix of w [..., out, in]: shape w.shape[:-2]."""
    amax = _abs_max(w, dim=(-2, -1))
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"nvfp4: weight of shape {tuple(w.shape)} has inf or NaN values")
    amax = amax.masked_fill(amax == 0, 1.0)
    return amax.float() / (E2M1_MAX * E4M3_MAX)


def _quantize_rows(rows: torch.Tensor, row_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [r, in] (any float dtype), row_g [r, 1] fp32 -> packed [r, in/2], scales [r, in/16]."""
    blocks = rows.unflatten(-1, (-1, BLOCK))
    scale = _abs_max(blocks, dim=-1).float() / (E2M1_MAX * row_g)
    scale = scale.masked_fill(scale == 0, 1.0)
    scale = scale.clamp(min=_MIN_BLOCK_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (scale.float() * row_g).unsqueeze(-1)
    return pack_nibbles(encode_e2m1(scaled).flatten(-2)), scale


def quantize_nvfp4(w: torch.Tensor, *, chunk_elems: int = CHUNK_ELEMS) -> dict[str, torch.Tensor]:
    """w [..., out, in] (bf16/fp16/fp32) -> NVFP4 parts by role, on w's device.

    Raises ValueError when `in` is not a multiple of 16 or w holds inf/NaN.
    """
    shape = tuple(w.shape)
    specs = stored_specs(shape)
    k = shape[-1]
    rows = w.reshape(-1, k)
    row_g = global_scale(w).unsqueeze(-1).expand(shape[:-1]).reshape(-1, 1)
    packed, scales = (
        torch.empty(specs[role][1], dtype=specs[role][0], device=w.device)
        for role in ("weight", "weight_scale")
    )
    packed_rows, scale_rows = packed.view(-1, k // 2), scales.view(-1, k // BLOCK)
    for rs in row_slices(rows.shape[0], k, chunk_elems):
        packed_rows[rs], scale_rows[rs] = _quantize_rows(rows[rs], row_g[rs])
    return {"weight": packed, "weight_scale": scales, "weight_scale_2": row_g.view(shape[:-1])}
