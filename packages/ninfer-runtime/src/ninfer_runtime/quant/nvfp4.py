"""NVFP4 weights: E2M1 codes, an FP8 (E4M3) scale per 16 inputs, an FP32 scale per source tensor.

Stored parts of a logical weight W [..., out, in] (the layout ModelOpt exports):

- `weight`          uint8 [..., out, in/2]: two E2M1 codes per byte, even input column in the low
                    nibble (`packing.py`). Code bit 3 is the sign, bits 0-2 index
                    `E2M1_MAGNITUDES` = {0, 0.5, 1, 1.5, 2, 3, 4, 6}; code 8 is -0.
- `weight_scale`    float8_e4m3fn [..., out, in/16]: the block scale s, row-major.
- `weight_scale_2`  fp32 [..., out]: the global scale g of the source tensor the row came from
                    (one value per source matrix or per expert, repeated on each of its rows, so
                    a fused [q; k; v] or a stacked expert tensor keeps every source's own g).

A weight is W[r, c] = e2m1(code[r, c]) * s[r, c // 16] * g[r]. The quantizer that produces these
parts (byte-exact with ModelOpt) is `ninfer_convert.quantize.nvfp4`.
"""

from __future__ import annotations

import torch

from ninfer_runtime.quant.packing import unpack_nibbles

ROLES = ("weight", "weight_scale", "weight_scale_2")
BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def stored_specs(shape: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    *lead, k = shape
    if k % BLOCK:
        raise ValueError(
            f"nvfp4 needs the input dim to be a multiple of {BLOCK}, got shape {shape}"
        )
    return {
        "weight": (torch.uint8, (*lead, k // 2)),
        "weight_scale": (torch.float8_e4m3fn, (*lead, k // BLOCK)),
        "weight_scale_2": (torch.float32, tuple(lead)),
    }


def e2m1_table(device: torch.device) -> torch.Tensor:
    """fp32 [16]: the value of each 4-bit code (8..15 are the negatives of 0..7)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat((magnitudes, -magnitudes))


def dequantize(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 [..., out, in]; each value is the exact product rounded once to fp32.

    NOTE: e2m1 * s is exact in fp32 (2 + 4 significant bits), so multiplying by g last rounds
    only once. ModelOpt's dequantize rounds s * g first and may differ by one ulp on 1.5/3/6.
    """
    codes = unpack_nibbles(parts["weight"])
    values = e2m1_table(codes.device)[codes.long()].unflatten(-1, (-1, BLOCK))
    block_scale = parts["weight_scale"].float().unsqueeze(-1)
    global_scale = parts["weight_scale_2"].float()[..., None, None]
    return ((values * block_scale) * global_scale).flatten(-2)
