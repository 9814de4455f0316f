"""Linear layers over plain or packed (quantized) weights.

The reference dequantizes a `PackedWeight` on every call and caches nothing: a kernel that
reads the packed bytes directly replaces it behind the same call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_runtime.quant import PackedWeight

Weight = torch.Tensor | PackedWeight


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T -> [..., out], in x.dtype."""
    weight = w.dequantize(x.dtype) if isinstance(w, PackedWeight) else w
    return F.linear(x, weight)


def select(w: Weight, index: int) -> Weight:
    """w[index] along the leading (expert) dim, keeping a packed weight packed."""
    if isinstance(w, PackedWeight):
        return PackedWeight(w.scheme, {role: part[index] for role, part in w.parts.items()},
                            w.shape[1:])
    return w[index]
