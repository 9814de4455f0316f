"""Decode-linear time against the K split's target grid size, on the GPU (one call, ~1 min).

`k_split` sizes the decode kernel's K split for a target number of programs per SM; the
decode tuner times quant_linear.SPLIT_TARGETS with each config. This times each target alone,
with the best config for it, on every 27B decode shape (the time includes the activation
pre-pass the kernel needs, as every call pays it):

    python3 scripts/split_sweep.py [--targets 4,8,16,32]

Its two H200 runs (docs/perf.md, 2026-12-03) refuted wave quantization as the decode
kernel's loss (every grid reached the same bandwidth) and retired the stream-K grids, slower
than a K split on every shape.
"""

from __future__ import annotations

import argparse

import torch

from ninfer_bench.ceilings import ceilings
from ninfer_bench.kernels.linear import (
    _rotating,
    _timed,
    model_weights,
    save_table,
    weight_bytes,
)
from ninfer_runtime.ops import quant_linear as ql


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--targets", default="4,8,16,32")
    p.add_argument("--schemes", default="nvfp4,groupwise-int")
    p.add_argument("--m", default="1,4")
    args = p.parse_args()
    targets = [int(t) for t in args.targets.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| shape | scheme | M | target | splits | config | us | % of BW |",
             "|---|---|---|---|---|---|---|---|"]
    for shape, scheme, ws in model_weights("27B", args.schemes.split(","), "cuda", gen):
        n, k = ws[0].shape
        size = weight_bytes(ws[0])
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            for target in targets:
                ql.SPLIT_TARGETS = (target,)
                ql._decode_plans.clear()
                us = _timed(_rotating(ws, x))  # its first call tunes for this split
                moved = size + 2 * m * (k + n)
                [plan] = ql._decode_plans.values()
                cfg = plan.config
                lines.append(f"| {shape} | {scheme} | {m} | {target} | {plan.splits} "
                             f"| BN={cfg.bn} w={cfg.warps} s={cfg.stages} d={cfg.dots} "
                             f"| {us:.1f} "
                             f"| {100 * moved / ceilings().bandwidth / (us * 1e-6):.1f}% |")
                print(lines[-1], flush=True)
        del ws  # before model_weights builds the next shape's copies
    save_table(lines, "split_sweep.md")


if __name__ == "__main__":
    main()
