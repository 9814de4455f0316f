"""Decode-linear time against the K split's target grid size, on the GPU (one call, ~1 min).

The hypothesis it tests (docs/perf.md, 2026-12-03): the quantized decode kernel loses half its
bandwidth to wave quantization. `k_split` at 4 programs per SM (counted with BN = 64) puts the
27B shapes at 1.03-1.45 waves of resident programs for every BN (e.g. gate_up, N = 34816:
136 / 272 / 544 programs for BN 256 / 128 / 64 where 132 / 264 / 528 fit at once), so a second,
nearly empty wave doubles the time. Larger targets give more, smaller K chunks: more waves
(less quantization loss), shorter pipelines per program and more fp32 partials; stream-K
grids (programs per SM sharing all K tiles evenly) remove the tail wave without shortening the
pipelines. The decode tuner already chooses among quant_linear.SPLIT_TARGETS and
STREAM_PROGRAMS_PER_SM; this times each grid alone, with the best config for it, on every 27B
decode shape:

    python3 scripts/split_sweep.py [--targets 4,8,16,32] [--streams 1,2,4,8]
"""

from __future__ import annotations

import argparse
import os

import torch
from triton.testing import do_bench_cudagraph

from ninfer_bench.kernels.linear import (
    BANDWIDTH,
    MODELS,
    _rotating,
    projections,
    random_weight,
    weight_bytes,
)
from ninfer_runtime.ops import quant_linear as ql
from ninfer_runtime.profiles import get_profile


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--targets", default="4,8,16,32")
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--schemes", default="nvfp4,groupwise-int")
    p.add_argument("--m", default="1,4")
    args = p.parse_args()
    grids = [("split", int(t)) for t in args.targets.split(",")] + [
        ("stream", int(t)) for t in args.streams.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| shape | scheme | M | grid | splits / programs | config | us | % of BW |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (n, k) in projections(get_profile(MODELS["27B"]).config).items():
        for scheme in args.schemes.split(","):
            first = random_weight(scheme, n, k, "cuda", gen)
            size = weight_bytes(first)
            copies = max(1, -(-4 * 50 * 2**20 // size))
            ws = [first] + [random_weight(scheme, n, k, "cuda", gen) for _ in range(copies - 1)]
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                for kind, target in grids:
                    ql.SPLIT_TARGETS = (target,) if kind == "split" else ()
                    ql.STREAM_PROGRAMS_PER_SM = (target,) if kind == "stream" else ()
                    ql._decode_plans.clear()
                    call = _rotating(ws, x)
                    call()  # tune the config for this split
                    torch.cuda.synchronize()
                    us = do_bench_cudagraph(call, rep=20, return_mode="median") * 1e3
                    moved = size + 2 * m * (k + n)
                    [plan] = ql._decode_plans.values()
                    cfg = plan.config
                    lines.append(f"| {name} {n}x{k} | {scheme} | {m} | {kind} {target} "
                                 f"| {plan.programs or plan.splits} "
                                 f"| BN={cfg.bn} w={cfg.warps} s={cfg.stages} d={cfg.dots} "
                                 f"| {us:.1f} "
                                 f"| {100 * moved / BANDWIDTH / (us * 1e-6):.1f}% |")
                    print(lines[-1], flush=True)
            del ws, first
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "split_sweep.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
