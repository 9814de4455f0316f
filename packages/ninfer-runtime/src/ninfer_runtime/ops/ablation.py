"""Timing-only ablations of a decode step's small kernels: NINFER_ABLATE=op[,op...].

Each named op is skipped where it runs on at most `DECODE_ROWS` tokens (decode and the
warm-up's short prompts; long prompts run everything) and its outputs are replaced by shared
zero buffers of the right shapes (`zeros`): the step's results are garbage, every other
kernel runs as before. `ninfer-bench engine` with and without an ablation measures what the op
adds to a CUDA-graphed decode step under PDL, which neither the eager breakdown (a PDL
kernel's profiled time includes its wait for the one before) nor a breakdown without PDL (no
overlap at all) tells (`NINFER_ABLATE=gdn bash scripts/tree_ab.sh run head` on the GPU
machine; docs/perf.md, thirty-first run). Never set it for results.

- norm: the decoder layer's input and post-attention RMSNorms (the residual adds with them;
  both the mixer and the MLP then read the residual stream as it came, which stays finite)
- act: the decode GEMV's activation pass (`quant_linear.activation_operands`)
- skinny: the GDN's in_proj_ba GEMV, which also writes in_proj_qkvz's operand
- gdn: the GDN decode with its output norm (which writes out_proj's operand)
- rope: the attention's q/k norms, partial RoPE and KV store
- attn: paged attention with its split merge (which writes o_proj's operand)
"""

from __future__ import annotations

import os

import torch

OPS = ("norm", "act", "skinny", "gdn", "rope", "attn")
DECODE_ROWS = 16  # quant_linear.SKINNY_MAX_M: the decode GEMV's rows


def _parse(value: str) -> frozenset[str]:
    names = frozenset(filter(None, (name.strip() for name in value.split(","))))
    unknown = sorted(names - set(OPS))
    if unknown:
        raise ValueError(f"NINFER_ABLATE: unknown ops {unknown}; known: {', '.join(OPS)}")
    return names


ABLATED = _parse(os.environ.get("NINFER_ABLATE", ""))


def ablated(op: str, x: torch.Tensor) -> bool:
    """Whether `op` is skipped for the tokens x [N, ...] (see the module docstring)."""
    assert op in OPS, op
    return op in ABLATED and x.shape[0] <= DECODE_ROWS


_ZEROS: dict[tuple, torch.Tensor] = {}


def zeros(role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
          ) -> torch.Tensor:
    """A zero buffer standing for an ablated op's output `role`: made on the shape's first
    call (the warm-up's eager steps come before any capture) and shared after, so that the
    graphed step launches nothing for it; zeros, not unwritten memory, keep the step's values
    finite (the sampler needs finite logits). Read, never written."""
    key = (role, tuple(shape), dtype, device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _ZEROS[key]
