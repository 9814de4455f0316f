"""The routed experts of one 35B-A3B MoE layer (H 2048, 256 experts, top-8, I 512).

`moe_experts` is timed whole with bf16, nvfp4 and groupwise-int experts, plus `route`. Decode
(1, 8 and 16 tokens: the GEMV path, gate|up + SiLU then down summed per token) is memory-bound:
its ratio is the bytes of the experts the step routes to (each counted once) over the copy
bandwidth. Prompts of 1,024-8,192 tokens are compute-bound: their ratio is 2 * T * k * 3 * H *
I FLOPs over the bf16 tensor-core rate. Each prompt size times both of ops.moe's prompt
paths, called directly whatever `moe_experts` would pick: in registers (align, grouped GEMMs
decoding their weight tiles per block, the weighted sum) and dequantized (each stacked weight
dequantized once, torch's grouped GEMM), and for packed experts the dequantized weights
through the in-register path's Triton GEMMs: where they cross sets ops.moe.DEQUANT_MIN_ROWS;
nvfp4 also times the in-register path with its tiles decoded to bf16 (before its fp16
operands).
Weights are random bytes in the stored layouts; routing is random (uniform) and changes from
call to call (a rotation of ROUTINGS draws), so consecutive calls read different experts, as
consecutive layers do.

Every time is per call from CUDA-graph replays of many calls (as the engine replays its decode
step): a decode call is shorter than its Python launch overhead, which plain event timing would
measure instead, and so is a 1,024-token prompt's on a slow host (the H200 of 2026-12-05's
fifteenth run took ~145 us a launch: eager timing put the path with two launches more 13%
behind). Each row also times the torch reference (one dequantized matmul per used expert; it
syncs with the host: timed eagerly). NINFER_BENCH_SCHEMES=nvfp4 narrows a run to those
schemes.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import torch

from ninfer_bench.ceilings import against_bandwidth, against_flops
from ninfer_runtime.ops.moe import (
    _launch_moe_dequantized,
    _launch_moe_experts,
    moe_experts,
    moe_experts_ref,
    route,
    route_ref,
)
from ninfer_runtime.ops.quant_linear import dequantize
from ninfer_runtime.profiles import get_profile
from ninfer_runtime.quant import PackedWeight, get_scheme

PROFILE = "qwen3_6_35b_a3b"
DECODE_TOKENS = (1, 8, 16)
PREFILL_TOKENS = (1024, 4096, 8192)


def _dequantized_triton(x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight,
                        *routing: torch.Tensor) -> torch.Tensor:
    """The dequantized path with the in-register path's Triton GEMMs in place of torch's
    grouped GEMM (its plain-weight case): the alternative if CUTLASS's loses."""
    return _launch_moe_experts(x, dequantize(gate_up, x.dtype), dequantize(down, x.dtype),
                               *routing)


# the prompt paths themselves, whichever moe_experts would pick
PROMPT_PATHS = {"in registers": _launch_moe_experts, "dequantized": _launch_moe_dequantized,
                "dequantized, Triton GEMM": _dequantized_triton}
# the paths timed per scheme
SCHEME_PATHS = {"nvfp4": tuple(PROMPT_PATHS), "groupwise-int": tuple(PROMPT_PATHS),
                "bf16": ("in registers", "dequantized")}
SCHEMES = tuple(SCHEME_PATHS)  # the engine's default format first
ROUTINGS = 16  # routing draws rotated through by consecutive timed calls


def _experts(scheme: str, e: int, n: int, k: int, device: str) -> torch.Tensor | PackedWeight:
    """Random stacked experts [e, n, k] in the stored layout of `scheme` (values ~ 1/sqrt(k))."""
    if scheme == "bf16":
        return (torch.randn(e, n, k, device=device) * k**-0.5).bfloat16()
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    if scheme == "nvfp4":
        parts = {"weight": codes,
                 "weight_scale": torch.rand(e, n, k // 16, device=device).add_(0.5)
                 .to(torch.float8_e4m3fn),
                 "weight_scale_2": torch.full((e, n), 0.1 * k**-0.5, device=device)}
    else:
        parts = {"weight": codes,
                 "weight_scale": torch.full((e, n, k // 128), 0.1 * k**-0.5, device=device,
                                            dtype=torch.bfloat16),
                 "weight_zero": torch.randint(0, 16, (e, n, k // 128), dtype=torch.uint8,
                                              device=device)}
    return PackedWeight(get_scheme(scheme), parts, (e, n, k))


def _bytes_per_expert(w: torch.Tensor | PackedWeight) -> int:
    tensors = w.parts.values() if isinstance(w, PackedWeight) else [w]
    return sum(t[0].numel() * t.element_size() for t in tensors)


def _time_us(fn: Callable[[], object]) -> float:
    """Median microseconds per call of fn, replayed in a CUDA graph (first call: autotune)."""
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def _eager_time_us(fn: Callable[[], object]) -> float:
    import triton

    fn()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _row(op: str, shape: str, us: float, ref_us: float, work: int, flops: bool) -> dict:
    return {"op": op, "shape": shape, "time_us": us, ("flops" if flops else "bytes"): work,
            **(against_flops if flops else against_bandwidth)(work, us), "ref_time_us": ref_us,
            "speedup_vs_ref": ref_us / us}


def _route_row(t: int, e: int, k: int, device: str) -> dict:
    logits = torch.randn(t, e, device=device, dtype=torch.bfloat16)
    return _row("route", f"35B-A3B T={t} E={e} k={k}", _time_us(lambda: route(logits, k)),
                _eager_time_us(lambda: route_ref(logits, k)), t * e * 2 + t * k * 16, False)


def _experts_rows(scheme: str, gate_up: torch.Tensor | PackedWeight,
                  down: torch.Tensor | PackedWeight, t: int, k: int, device: str) -> list[dict]:
    e, two_inter, h = gate_up.shape
    inter = two_inter // 2
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    routings = [route_ref(torch.randn(t, e, device=device), k) for _ in range(ROUTINGS)]
    turn = itertools.cycle(routings)
    ref_us = _eager_time_us(lambda: moe_experts_ref(x, gate_up, down, *routings[0]))
    shape = f"35B-A3B {scheme} T={t} H={h} I={inter} E={e} k={k}"
    if t in PREFILL_TOKENS:
        return [_row(f"moe_experts prefill, {name}", shape,
                     _time_us(lambda path=PROMPT_PATHS[name]: path(x, gate_up, down, *next(turn))),
                     ref_us, 2 * t * k * 3 * h * inter, True)
                for name in SCHEME_PATHS[scheme]]
    us = _time_us(lambda: moe_experts(x, gate_up, down, *next(turn)))
    active = sum(ids.unique().numel() for _, ids in routings) / ROUTINGS
    moved = round(active * (_bytes_per_expert(gate_up) + _bytes_per_expert(down))) + 2 * t * h * 2
    return [_row("moe_experts decode", f"{shape} ({active:.1f} experts)", us, ref_us, moved,
                 False)]


def bench(device: str = "cuda") -> Iterator[dict]:
    """Median times of moe_experts per scheme and token count (prompts first: they set
    DEQUANT_MIN_ROWS) and of route, with their ratios, each row as it is measured."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"the MoE kernel benchmark needs a CUDA device, not {device!r}")
    cfg = get_profile(PROFILE).config
    h, e, k, inter = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                      cfg.moe_intermediate_size)
    torch.manual_seed(0)
    narrowed = [s for s in os.environ.get("NINFER_BENCH_SCHEMES", "").split(",") if s]
    for scheme in narrowed or SCHEMES:
        gate_up = _experts(scheme, e, 2 * inter, h, device)
        down = _experts(scheme, e, h, inter, device)
        for t in PREFILL_TOKENS[::-1] + DECODE_TOKENS:
            yield from _experts_rows(scheme, gate_up, down, t, k, device)
    for t in DECODE_TOKENS + PREFILL_TOKENS:
        yield _route_row(t, e, k, device)
