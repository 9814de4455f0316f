"""Partial NeoX-style rotary embedding over the first `rotary_dim` dims of each head.

Qwen3.5 uses interleaved mRoPE (t, h, w position components); for text all three components
are equal and it reduces to this ordinary 1-D RoPE. Vision positions need the mRoPE section map
and are not handled here.
"""

from __future__ import annotations

import torch


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
