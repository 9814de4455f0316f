"""The fused elementwise / row kernels against the copy-bandwidth ceiling.

add_rms_norm, rms_norm, gated_rms_norm (GDN output), qk_norm_rope (attention) and silu_and_mul
at the shapes the 27B and 35B-A3B models run them, for decode (M = 1, 8 tokens) and prefill
chunks (M = 1024, 8192). All are memory-bound: the ceiling is the bytes each must read and
write at the card's copy bandwidth (ninfer_bench.ceilings). Decode sizes move a few KB and show
launch latency, not bandwidth. Each row also times the torch reference, so the fusion's gain is
visible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer_bench.ceilings import against_bandwidth
from ninfer_runtime.config import ModelConfig
from ninfer_runtime.ops.activation import silu_and_mul, silu_and_mul_ref
from ninfer_runtime.ops.norm import (
    add_rms_norm,
    add_rms_norm_ref,
    gated_rms_norm,
    gated_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from ninfer_runtime.ops.rope import qk_norm_rope, qk_norm_rope_ref, rope_cos_sin
from ninfer_runtime.profiles import get_profile

MODELS = {"27B": "qwen3_6_27b", "35B-A3B": "qwen3_6_35b_a3b"}
TOKENS = (1, 8, 1024, 8192)
EPS = 1e-6


@dataclass(frozen=True)
class Case:
    op: str
    shape: str
    bytes: int  # read + written once each
    kernel: Callable[[], object]
    ref: Callable[[], object]


def _cases(cfg: ModelConfig, m: int, device: str) -> list[Case]:
    """The five ops for M tokens of one model, on random bf16 inputs shaped as in the layer."""
    bf16, e = torch.bfloat16, 2  # e: bytes per bf16 element

    def randn(*shape: int, dtype: torch.dtype = bf16) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    h = cfg.hidden_size
    x, res, w = randn(m, h), randn(m, h), randn(h) * 0.1
    cases = [
        Case("rms_norm", f"[{m}, {h}]", 2 * m * h * e + h * e,
             lambda: rms_norm(x, w, EPS), lambda: rms_norm_ref(x, w, EPS)),
        Case("add_rms_norm", f"[{m}, {h}]", 4 * m * h * e + h * e,
             lambda: add_rms_norm(x, res, w, EPS), lambda: add_rms_norm_ref(x, res, w, EPS)),
    ]

    nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    gdn_out = randn(m, nv, dv)
    z = randn(m, cfg.conv_dim + cfg.linear_value_dim)[:, cfg.conv_dim:].reshape(m, nv, dv)
    gw = 1.0 + randn(dv) * 0.1
    cases.append(Case("gated_rms_norm", f"[{m}, {nv}, {dv}]", 3 * m * nv * dv * e + dv * e,
                      lambda: gated_rms_norm(gdn_out, z, gw, EPS),
                      lambda: gated_rms_norm_ref(gdn_out, z, gw, EPS)))

    nq, nkv, hd, rot = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.rotary_dim)
    q_gate, k, _ = randn(m, 2 * nq * hd + 2 * nkv * hd).split(
        [2 * nq * hd, nkv * hd, nkv * hd], dim=-1)
    q, k = q_gate.reshape(m, nq, 2 * hd)[..., :hd], k.reshape(m, nkv, hd)
    cos, sin = rope_cos_sin(torch.arange(m, device=device) + 5000, rot, cfg.rope_theta)
    qw, kw = randn(hd) * 0.1, randn(hd) * 0.1
    qk_bytes = 2 * m * (nq + nkv) * hd * e + 2 * m * rot * 4 + 2 * hd * e
    cases.append(Case("qk_norm_rope", f"q [{m}, {nq}, {hd}] k [{m}, {nkv}, {hd}] rot {rot}",
                      qk_bytes, lambda: qk_norm_rope(q, k, qw, kw, cos, sin, EPS),
                      lambda: qk_norm_rope_ref(q, k, qw, kw, cos, sin, EPS)))

    # dense MLP, or the routed experts' rows (each token goes to num_experts_per_tok experts)
    rows, inter = ((m * cfg.num_experts_per_tok, cfg.moe_intermediate_size) if cfg.is_moe
                   else (m, cfg.intermediate_size))
    gate_up = randn(rows, 2 * inter)
    cases.append(Case("silu_and_mul", f"[{rows}, {2 * inter}]", 3 * rows * inter * e,
                      lambda: silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up)))
    return cases


def bench(device: str = "cuda") -> list[dict]:
    """Median kernel and reference times per op, model and M, with the bandwidth ratio."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"the elementwise kernel benchmark needs a CUDA device, not {device!r}")
    from triton.testing import do_bench

    rows = []
    for label, profile in MODELS.items():
        cfg = get_profile(profile).config
        for m in TOKENS:
            for case in _cases(cfg, m, device):
                us = do_bench(case.kernel, warmup=25, rep=100, return_mode="median") * 1e3
                ref_us = do_bench(case.ref, warmup=25, rep=100, return_mode="median") * 1e3
                rows.append({
                    "op": case.op, "shape": f"{label} {case.shape}", "time_us": us,
                    "bytes": case.bytes, **against_bandwidth(case.bytes, us), "ref_time_us": ref_us,
                    "speedup_vs_ref": ref_us / us,
                })
    return rows
