"""Where a short decode GEMV's time goes beyond its bytes (GPU, ~1 min).

The twenty-sixth run found the 27B's decode GEMVs at 47-74% of the copy bandwidth where a
program walks 4-7 K tiles, and the lm_head at 94% where it walks 20 (docs/perf.md); whole
waves did not help (twenty-seventh). This times a fixed grid of programs (N / BN row tiles x
--splits K parts, the default config) while the K tiles each program walks double, streaming
over weight copies as the decode tuner does (`tuner.streaming_times`), three ways:

- `call`: as the tuner times it, the activation pass included;
- `kernel`: the decode kernel alone, on an operand made beforehand (as the engine's norms
  make it for most GEMVs);
- `unsplit`: the same programs over a weight [N x splits, K / splits], no K parts to add.

A line through `kernel` against the tiles gives a call's fixed cost (the intercept: its start
behind the predecessor, the first tiles' latency, the last programs' tail) and a tile's cost
(the slope, against the tile's bytes at the measured bandwidth); `call - kernel` is the
activation pass, `kernel - unsplit` the sum of the K parts.

    python3 scripts/gemv_anatomy.py [--n 16384] [--splits 3] [--tiles 1,2,4,8,16]
"""

from __future__ import annotations

import argparse

import torch

from ninfer_bench.ceilings import ceilings
from ninfer_bench.kernels.linear import random_weight, save_table, weight_bytes
from ninfer_runtime.ops import quant_linear as ql
from ninfer_runtime.ops import tuner


def _us(plan: ql.DecodePlan, runs: list) -> float:
    return tuner.streaming_times([plan], runs)[0] * 1e3


def _times(n: int, k: int, splits: int, gen: torch.Generator) -> tuple[float, float, int]:
    """(call us, kernel us, weight bytes) of x [1, k] @ w [n, k]^T in `splits` K parts."""
    w = random_weight("nvfp4", n, k, "cuda", gen)
    ops = ql._operands(w)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    config = ql.decode_candidates(n, k, ops.layout.scheme, x.device)[0].config
    plan = ql.DecodePlan(config, k // splits, splits)
    call = _us(plan, ql.decode_runs(x, ops, out))
    made = ql.activation_operands(x, config.bk, False)  # as the engine's norms make it
    return call, _us(plan, ql.decode_runs(x, ops, out, operand=made)), weight_bytes(w)


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((a - mx) * (b - my) for a, b in zip(xs, ys, strict=True))
             / sum((a - mx) ** 2 for a in xs))
    return my - slope * mx, slope


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=16384)  # in_proj_qkvz's rows: 128 tiles of BN 128
    p.add_argument("--splits", type=int, default=3)  # 384 programs: one wave on 132 SMs
    p.add_argument("--tiles", default="1,2,4,8,16")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = ceilings().bandwidth
    tiles = [int(t) for t in args.tiles.split(",")]
    n, s = args.n, args.splits
    lines = [f"N = {n}, {s} K splits, nvfp4, one row; us a call, streaming over weight copies",
             "", "| K tiles a program | K | call | kernel | unsplit | kernel at the bandwidth |",
             "|---|---|---|---|---|---|"]
    kernels = []
    for t in tiles:
        bk = 256  # every nvfp4 decode config's K tile
        k = t * bk * s
        call, kernel, nbytes = _times(n, k, s, gen)
        _, unsplit, _ = _times(n * s, k // s, 1, gen)
        kernels.append(kernel)
        ideal = nbytes / bandwidth * 1e6
        lines.append(f"| {t} | {k} | {call:.1f} | {kernel:.1f} | {unsplit:.1f} "
                     f"| {100 * ideal / kernel:.0f}% ({ideal:.1f} us) |")
        print(lines[-1], flush=True)
    fixed, per_tile = _line(tiles, kernels)
    tile_bytes = nbytes / tiles[-1]  # one K tile of every program
    lines += ["", f"kernel = {fixed:.2f} us + {per_tile:.2f} us a K tile; a tile's bytes at the "
              f"slope: {tile_bytes / (per_tile * 1e-6) / 1e12:.2f} TB/s "
              f"(bandwidth {bandwidth / 1e12:.2f})"]
    print(lines[-1])
    save_table(lines, "gemv_anatomy.md")


if __name__ == "__main__":
    main()
