"""groupwise-int storage layout (placeholder being completed by the quant helper)."""

from __future__ import annotations

import torch

ROLES = ("weight", "weight_scale", "weight_zero")
GROUP = 128


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
    raise NotImplementedError
