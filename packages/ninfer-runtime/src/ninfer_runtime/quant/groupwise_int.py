"""groupwise-int weights: asymmetric uint4 codes in groups of 128 inputs, bf16 scale, uint8 zero.

Stored parts of a logical weight W [..., out, in]:

- `weight`       uint8 [..., out, in/2]: codes q in [0, 15], two per byte, even input column in
                 the low nibble (the same packing as nvfp4, `packing.py`).
- `weight_scale` bf16 [..., out, in/128]: the group's step.
- `weight_zero`  uint8 [..., out, in/128]: the group's integer zero point, in [0, 15], so 0.0 is
                 exactly representable.

W[r, c] = (q[r, c] - zero[r, c // 128]) * scale[r, c // 128]. The quantizer (round to nearest
with a per-group clipping search) is `ninfer_convert.quantize.groupwise_int`.
"""

from __future__ import annotations

import torch

from ninfer_runtime.quant.packing import unpack_nibbles

ROLES = ("weight", "weight_scale", "weight_zero")
GROUP = 128
MAX_CODE = 15


def stored_specs(shape: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    *lead, k = shape
    if k % GROUP:
        raise ValueError(
            f"groupwise-int needs the input dim to be a multiple of {GROUP}, got shape {shape}"
        )
    return {
        "weight": (torch.uint8, (*lead, k // 2)),
        "weight_scale": (torch.bfloat16, (*lead, k // GROUP)),
        "weight_zero": (torch.uint8, (*lead, k // GROUP)),
    }


def dequantize(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 [..., out, in] = (q - zero) * scale."""
    codes = unpack_nibbles(parts["weight"]).float().unflatten(-1, (-1, GROUP))
    zero = parts["weight_zero"].float().unsqueeze(-1)
    scale = parts["weight_scale"].float().unsqueeze(-1)
    return ((codes - zero) * scale).flatten(-2)
