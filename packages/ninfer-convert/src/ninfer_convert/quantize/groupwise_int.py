"""groupwise-int quantizer: asymmetric uint4, 128 inputs per group, clipping search per group.

For each group x of 128 inputs the range [lo, hi] = [min(x, 0), max(x, 0)] (so 0 stays exactly
representable and the zero point lands in [0, 15]) is shrunk towards 0 by each factor in
CLIP_FACTORS; a factor gives scale = bf16((hi - lo) * f / 15), zero = round(-lo * f / scale) and
codes q = clamp(round(x / scale + zero), 0, 15). Each group keeps the factor with the least
squared error of (q - zero) * scale against x, measured with the bf16 scale actually stored.
Factor 1.0 is plain min/max round-to-nearest, so the search is never worse than it: clipping
a few outliers buys a finer step for the other 127 values. A group of zeros gets scale 1.

The search is vectorised over all groups of a row chunk (`chunking.py`); the factors loop.
"""

from __future__ import annotations

import torch

from ninfer_convert.quantize.chunking import CHUNK_ELEMS, row_slices
from ninfer_runtime.quant.groupwise_int import GROUP, MAX_CODE, stored_specs
from ninfer_runtime.quant.packing import pack_nibbles

CLIP_FACTORS = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0, 0.95, ..., 0.5


def _params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Range [lo <= 0 <= hi] -> (scale rounded to bf16, integer zero), both fp32."""
    scale = ((hi - lo) / MAX_CODE).to(torch.bfloat16).float()
    scale = scale.masked_fill(scale == 0, 1.0)
    zero = torch.round(-lo / scale).clamp_(0, MAX_CODE)
    return scale, zero


def _codes(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round(groups / scale + zero).clamp_(0, MAX_CODE)


def _search(
    groups: torch.Tensor, clip_factors: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """groups fp32 [r, g, 128] -> (scale, zero) fp32 [r, g, 1] with the least squared error."""
    lo = groups.amin(-1, keepdim=True).clamp_(max=0)
    hi = groups.amax(-1, keepdim=True).clamp_(min=0)
    best_err = torch.full_like(lo, float("inf"))
    best_scale, best_zero = torch.ones_like(lo), torch.zeros_like(lo)
    for factor in clip_factors:
        scale, zero = _params(lo * factor, hi * factor)
        err = ((_codes(groups, scale, zero) - zero) * scale - groups).square_().sum(-1, True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def quantize_groupwise_int(
    w: torch.Tensor,
    *,
    clip_factors: tuple[float, ...] = CLIP_FACTORS,
    chunk_elems: int = CHUNK_ELEMS,
) -> dict[str, torch.Tensor]:
    """w [..., out, in] -> groupwise-int parts by role, on w's device.

    `clip_factors=(1.0,)` is plain min/max round-to-nearest. Raises ValueError when `in` is not
    a multiple of 128 or no factor is given.
    """
    shape = tuple(w.shape)
    specs = stored_specs(shape)
    if not clip_factors:
        raise ValueError("groupwise-int needs at least one clip factor")
    k = shape[-1]
    rows = w.reshape(-1, k)
    parts = {
        role: torch.empty(dtype_shape[1], dtype=dtype_shape[0], device=w.device)
        for role, dtype_shape in specs.items()
    }
    packed = parts["weight"].view(-1, k // 2)
    scales = parts["weight_scale"].view(-1, k // GROUP)
    zeros = parts["weight_zero"].view(-1, k // GROUP)
    for rs in row_slices(rows.shape[0], k, chunk_elems):
        groups = rows[rs].float().unflatten(-1, (-1, GROUP))
        scale, zero = _search(groups, clip_factors)
        packed[rs] = pack_nibbles(_codes(groups, scale, zero).to(torch.uint8).flatten(-2))
        scales[rs] = scale.squeeze(-1).to(torch.bfloat16)
        zeros[rs] = zero.squeeze(-1).to(torch.uint8)
    return parts
