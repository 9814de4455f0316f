"""RMSNorm variants of Qwen3.5: zero-centred (1 + w) everywhere, plain w in the GDN gated norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + w) over the last dim, in fp32, cast back to x.dtype.

    Qwen3.5 stores these weights zero-centred (initialised to 0), so the scale is 1 + w.
    """
    return (_normalize(x, eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The GDN output norm: (w * x / rms(x)) * silu(z) over the last dim (norm before gate).

    Unlike `rms_norm` the weight is plain (initialised to 1). The normalised x is rounded to
    x.dtype before the weight multiply, as the reference implementation does.
    """
    normed = weight * _normalize(x, eps).to(x.dtype)
    return (normed * F.silu(z.float())).to(x.dtype)
