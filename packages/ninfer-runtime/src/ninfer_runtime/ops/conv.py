"""Causal depthwise conv1d (+ SiLU) of the GDN layer, with a rolling conv state.

The conv state of one sequence holds the last K-1 *pre-activation* inputs, [C, K-1], oldest
first; a fresh sequence starts from zeros, which equals the zero left-padding of a plain causal
conv. Both forms apply SiLU to the conv output, as the fused kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill form: x [T, C], weight [C, K], state [C, K-1] -> (silu(conv) [T, C], new state).

    out[t, c] = sum_j weight[c, j] * xs[t + j, c] over xs = [state^T ; x] (K-1+T rows).
    """
    kernel = weight.shape[-1]
    xs = torch.cat([state.transpose(0, 1).to(x.dtype), x], dim=0)  # [K-1+T, C]
    # conv1d wants [batch, C, len]; groups=C makes it depthwise, no padding as xs carries it.
    out = F.conv1d(xs.transpose(0, 1)[None].float(), weight.float()[:, None, :],
                   groups=weight.shape[0])[0].transpose(0, 1)
    new_state = xs[-(kernel - 1):].transpose(0, 1).to(state.dtype)
    return F.silu(out).to(x.dtype), new_state


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode form for one new token per sequence: x [..., C], state [..., C, K-1].

    Returns (silu(conv) [..., C], new state [..., C, K-1]); leading dims batch sequences.
    """
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [..., C, K]
    out = (window.float() * weight.float()).sum(-1)
    return F.silu(out).to(x.dtype), window[..., 1:].to(state.dtype)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                         cu_seqlens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Several sequences back to back, each continuing from its slot of a state pool.

    x [N, C] holds sequence b at rows cu_seqlens[b] .. cu_seqlens[b+1] ([B+1]); its conv state
    is states[slots[b]] (states [num_slots, C, K-1], slots [B]), which this replaces. A
    one-token sequence takes the decode form, a longer one the prefill form. Returns [N, C].
    """
    out = torch.empty_like(x)
    # NOTE: the reference loops over sequences on the host; a kernel takes the tensors.
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        if hi - lo == 1:
            out[lo], states[slot] = causal_conv1d_update(x[lo], weight, states[slot])
        else:
            out[lo:hi], states[slot] = causal_conv1d(x[lo:hi], weight, states[slot])
    return out
