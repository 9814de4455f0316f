"""The Gated DeltaNet kernels against their ceilings, per layer, at the 27B and 35B-A3B shapes.

* `gdn_decode` (fused conv + gating + recurrent step) at batch 1, 4, 8 and a speculative
  verify (4 tokens, a snapshot per token): memory-bound, dominated by reading and writing the
  fp32 recurrent state (27B: 48 x 128 x 128 x 4 B = 3 MiB a sequence, each way). Real decode
  touches a different layer's state every launch, so the state pools rotate over more memory
  than L2 holds. Each row also times the unfused kernels (conv varlen, gating, chunked rule);
  at batch 1 and 8 extra rows force each column tile (BV 16 / 32) of the decode kernel, to
  check the launcher's choice (`ops.gdn._decode_tile`).
* `causal_conv1d_varlen` over prompt chunks: memory-bound.
* `gated_delta_rule_varlen` (chunked) over one prompt: reported against the bf16 tensor-core
  rate with the FLOPs of the algorithm as implemented, counted once per head (dv-block
  programs repeat the [C, C] work; that repetition is not counted).

Every time is per call from CUDA-graph replays of many calls (as the engine replays its decode
steps): a decode launch is shorter than the Python that issues it, so plain event timing would
measure the host, not the kernel.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from ninfer_bench.ceilings import against_bandwidth, against_flops
from ninfer_runtime.config import ModelConfig
from ninfer_runtime.ops.conv import causal_conv1d_varlen
from ninfer_runtime.ops.gdn import (
    CHUNK_SIZE,
    _launch_decode,
    gated_delta_rule_varlen,
    gdn_decode,
    gdn_gating,
    prompt_kernels,
)
from ninfer_runtime.profiles import get_profile

MODELS = {"27B": "qwen3_6_27b", "35B-A3B": "qwen3_6_35b_a3b"}
DECODE_BATCHES = (1, 4, 8)
TILE_BATCHES = (1, 8)  # batches whose rows also force each decode column tile
DECODE_TILES = (16, 32)
VERIFY_TOKENS = 4  # MTP3: the last accepted token and 3 drafts
PREFILL_TOKENS = (1024, 8192)
ROTATE_BYTES = 256 << 20  # state pools rotated per call: several times the 50 MB L2


def _time_us(fn: Callable[[], object]) -> float:
    """Median microseconds per call of fn, replayed in a CUDA graph (first call: compile)."""
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def _segments(lengths: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64, device=device)
    return cu, torch.arange(len(lengths), dtype=torch.int64, device=device)


def _decode_rows(label: str, cfg: ModelConfig, device: str) -> list[dict]:
    nv, nk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    dk, dv, kernel, cdim = (cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                            cfg.linear_conv_kernel_dim, cfg.conv_dim)
    bf16 = torch.bfloat16
    weight = torch.randn(cdim, kernel, device=device, dtype=bf16) * 0.5
    a_log, dt_bias = torch.rand(nv, device=device).log(), torch.randn(nv, device=device)
    cases = [(f"gdn_decode B={b}", [1] * b, False) for b in DECODE_BATCHES]
    cases.append((f"gdn_decode verify T={VERIFY_TOKENS} +snapshots", [VERIFY_TOKENS], True))
    rows = []
    for name, lengths, snapshots in cases:
        n, seqs = sum(lengths), len(lengths)
        cu, slots = _segments(lengths, device)
        # own slots 0..B-1, then one snapshot slot per token
        num_slots = seqs + (n if snapshots else 0)
        snap = torch.arange(seqs, seqs + n, device=device) if snapshots else None
        state_bytes = num_slots * nv * dk * dv * 4
        pools = [(torch.zeros(num_slots, cdim, kernel - 1, device=device, dtype=bf16),
                  torch.zeros(num_slots, nv, dk, dv, device=device))
                 for _ in range(max(2, ROTATE_BYTES // state_bytes))]
        proj = torch.randn(n, cdim + 2 * nv, device=device, dtype=bf16)
        mixed, b, a = proj.split([cdim, nv, nv], dim=-1)
        turn = itertools.cycle(pools)

        def fused(mixed=mixed, a=a, b=b, cu=cu, slots=slots, snap=snap, turn=turn,
                  block_v=None) -> None:
            conv, states = next(turn)
            if block_v is None:
                gdn_decode(mixed, a, b, weight, a_log, dt_bias, conv, states, cu, slots, snap)
            else:
                _launch_decode(mixed, a, b, weight, a_log, dt_bias, conv, states, cu, slots,
                               snap, block_v=block_v)

        def unfused(mixed=mixed, a=a, b=b, cu=cu, slots=slots, turn=turn, n=n) -> None:
            conv, states = next(turn)
            y = causal_conv1d_varlen(mixed, weight, conv, cu, slots)
            q, k, v = y.split([nk * dk, nk * dk, nv * dv], dim=-1)
            g, beta = gdn_gating(a, b, a_log, dt_bias)
            gated_delta_rule_varlen(q.reshape(n, nk, dk), k.reshape(n, nk, dk),
                                    v.reshape(n, nv, dv), g, beta, states, cu, slots)

        state_rw = nv * dk * dv * 4 * (seqs + n)  # read own slot once, write once per token
        conv_rw = cdim * (kernel - 1) * 2 * (seqs + n)
        moved = state_rw + conv_rw + n * (cdim + 2 * nv + nv * dv) * 2 + weight.numel() * 2
        shape = f"{label} nk={nk} nv={nv} dk={dk} dv={dv}"
        row = _decode_row(name, shape, _time_us(fused), moved)
        if not snapshots:
            row["unfused_time_us"] = _time_us(unfused)
        rows.append(row)
        if not snapshots and seqs in TILE_BATCHES:
            rows += [_decode_row(f"{name} BV={bv}", shape,
                                 _time_us(lambda bv=bv, fused=fused: fused(block_v=bv)), moved)
                     for bv in DECODE_TILES]
    return rows


def _decode_row(op: str, shape: str, us: float, moved: int) -> dict:
    return {"op": op, "shape": shape, "time_us": us, "bytes": moved,
            **against_bandwidth(moved, us)}


def _chunk_flops(tokens: int, nv: int, dk: int, dv: int, c: int = CHUNK_SIZE) -> int:
    """FLOPs of the chunked kernel per chunk and head: the two [C, C] Gram tiles, the
    blockwise triangular inverse (four [C, C] products), u, w, the state products and the
    intra-chunk output."""
    per_chunk = (2 * c * c * dk * 2 + 8 * c ** 3 + 2 * c * c * dv + 2 * c * c * dk
                 + 3 * 2 * c * dk * dv + 2 * c * c * dv)
    return -(-tokens // c) * nv * per_chunk


def _prefill_rows(label: str, cfg: ModelConfig, device: str) -> list[dict]:
    nv, nk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    dk, dv, kernel, cdim = (cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                            cfg.linear_conv_kernel_dim, cfg.conv_dim)
    bf16 = torch.bfloat16
    weight = torch.randn(cdim, kernel, device=device, dtype=bf16) * 0.5
    conv = torch.zeros(1, cdim, kernel - 1, device=device, dtype=bf16)
    states = torch.zeros(1, nv, dk, dv, device=device)
    rows = []
    for m in PREFILL_TOKENS:
        cu, slots = _segments([m], device)
        x = torch.randn(m, cdim, device=device, dtype=bf16)
        us = _time_us(lambda x=x, cu=cu, slots=slots: causal_conv1d_varlen(
            x, weight, conv, cu, slots))
        moved = 2 * m * cdim * 2 + weight.numel() * 2
        rows.append({"op": "causal_conv1d_varlen", "shape": f"{label} [{m}, {cdim}]",
                     "time_us": us, "bytes": moved, **against_bandwidth(moved, us)})

        q, k = (torch.randn(m, nk, dk, device=device, dtype=bf16) for _ in range(2))
        v = torch.randn(m, nv, dv, device=device, dtype=bf16)
        g, beta = gdn_gating(torch.randn(m, nv, device=device), torch.randn(m, nv, device=device),
                             torch.rand(nv, device=device).log(), torch.randn(nv, device=device))
        us = _time_us(lambda q=q, k=k, v=v, g=g, beta=beta, cu=cu, slots=slots:
                      gated_delta_rule_varlen(q, k, v, g, beta, states, cu, slots))
        flops = _chunk_flops(m, nv, dk, dv)
        rows.append({"op": f"gated_delta_rule_varlen (chunked, {prompt_kernels()}'s)",
                     "shape": f"{label} T={m} nk={nk} nv={nv}", "time_us": us, "flops": flops,
                     "tokens_per_s": m / (us * 1e-6), **against_flops(flops, us)})
    return rows


def bench(device: str = "cuda") -> list[dict]:
    """Median times of the GDN kernels per model: decode (fused, and unfused for comparison),
    speculative verify, and the prompt path (conv, chunked rule)."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"the GDN kernel benchmark needs a CUDA device, not {device!r}")
    rows = []
    for label, profile in MODELS.items():
        cfg = get_profile(profile).config
        rows += _decode_rows(label, cfg, device)
        rows += _prefill_rows(label, cfg, device)
    return rows
