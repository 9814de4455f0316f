"""NVFP4 storage layout (placeholder being completed by the quant helper)."""

from __future__ import annotations

import torch

ROLES = ("weight", "weight_scale", "weight_scale_2")
BLOCK = 16


def stored_specs(shape: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    *lead, k = shape
    if k % BLOCK:
        raise ValueError(f"nvfp4 needs the input dim to be a multiple of {BLOCK}, got shape {shape}")
    return {
        "weight": (torch.uint8, (*lead, k // 2)),
        "weight_scale": (torch.float8_e4m3fn, (*lead, k // BLOCK)),
        "weight_scale_2": (torch.float32, tuple(lead)),
    }


def dequantize(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    raise NotImplementedError
