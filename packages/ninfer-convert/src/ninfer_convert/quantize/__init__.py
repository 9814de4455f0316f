"""Converter-side weight quantizers: one logical weight in, its stored parts by role out.

`quantize(scheme, w)` is what the converter calls for every weight. The parts it returns follow
the layouts fixed in `ninfer_runtime.quant` (roles, dtypes, shapes; `stored_specs`), and
`ninfer_runtime.quant.get_scheme(scheme).dequantize_parts` is their reference inverse.
Quantization runs on w's device (pure torch), in row chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer_convert.quantize.groupwise_int import quantize_groupwise_int
from ninfer_convert.quantize.nvfp4 import quantize_nvfp4
from ninfer_runtime.quant import get_scheme

__all__ = ["quantize", "quantize_groupwise_int", "quantize_nvfp4"]

_QUANTIZERS: dict[str, Callable[[torch.Tensor], dict[str, torch.Tensor]]] = {
    "nvfp4": quantize_nvfp4,
    "groupwise-int": quantize_groupwise_int,
}


@torch.no_grad()
def quantize(scheme: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Store w [..., out, in] under `scheme`: {role: tensor}; plain schemes just cast.

    Raises UnknownSchemeError for an unknown scheme and ValueError for a weight the scheme cannot
    hold (not floating point, fewer than 2 dims, input dim not a multiple of the block/group).
    """
    spec = get_scheme(scheme)
    if not spec.quantized:
        dtype, _ = spec.stored_specs(tuple(w.shape))["weight"]
        return {"weight": w.to(dtype)}
    if w.ndim < 2 or not w.is_floating_point():
        raise ValueError(
            f"{scheme} quantizes float weights [..., out, in], got {w.dtype} {tuple(w.shape)}"
        )
    return _QUANTIZERS[scheme](w)
