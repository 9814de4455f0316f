"""Two 4-bit codes per byte, packed along the last (input, K) dim.

Element 2i sits in the LOW nibble of byte i and element 2i+1 in the HIGH nibble: ModelOpt's
NVFP4 order and Triton `tl.dot_scaled`'s ("first element in lower bits"). Both 4-bit schemes
use it, so one unpack serves every kernel.
"""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], shape [..., 2n] -> uint8 [..., n]."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> uint8 codes [..., 2n] (inverse of `pack_nibbles`)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
