"""Time the candidate CUDA-core decode GEMV (`ops.quant_gemv`) against today's `linear()`.

For the 27B projection shapes, nvfp4 and groupwise-int, M = 1 and 4 activation rows: the current
path (`linear()`, the autotuned tensor-core decode kernel) and `quant_gemv.gemv` over a small
config grid, each checked against `linear()`'s output. Prints one Markdown table (time, % of
the 4.24 TB/s copy bandwidth for packed codes + scales + x + out, best per group marked) and
writes it to $OUT/gemv_sweep.md when OUT is set.

    .venv/bin/python scripts/gemv_sweep.py              # on an H200, well under 90 s
    .venv/bin/python scripts/gemv_sweep.py --dry-run    # CPU: one tiny shape, interpreter

Timing: one CUDA graph holds >= 24 calls that cycle over enough weight copies to exceed 4x the
50 MB L2 (reads come from HBM); median of 7 replays, divided by the calls. Every config of one
(scheme, M) is one compiled kernel whatever the shape (split count and M are runtime
arguments), so compile time is paid once per grid entry, not per shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

DRY = "--dry-run" in sys.argv
if DRY and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    os.environ["NINFER_OPS"] = "triton"

from ninfer_bench.kernels.linear import BANDWIDTH, L2_BYTES, random_weight, weight_bytes  # noqa: E402
from ninfer_runtime.ops import quant_gemv  # noqa: E402
from ninfer_runtime.ops.linear import linear  # noqa: E402
from ninfer_runtime.ops.quant_gemv import GemvConfig  # noqa: E402
from ninfer_runtime.ops.quant_linear import _operands  # noqa: E402
from ninfer_runtime.quant import PackedWeight  # noqa: E402

SHAPES = {  # Qwen3.6-27B decode projections, (N, K)
    "in_proj_qkvz": (16384, 5120),
    "o_proj": (5120, 6144),
    "gate_up": (34816, 5120),
    "down": (5120, 17408),
    "lm_head": (248320, 5120),
}
SCHEMES = ("nvfp4", "groupwise-int")
MS = (1, 4)
# (block_n, block_k, num_warps) per M; num_stages stays 1: the kernel prefetches the next tile
# into registers itself and Triton's pipeliner leaves these loads alone (same SASS for 1 and 3)
KERNELS = {
    1: [(64, 512, 4), (32, 512, 4), (128, 512, 8), (128, 256, 4)],
    4: [(16, 512, 4), (32, 512, 4), (32, 256, 4)],
}
CALLS_PER_GRAPH = 24
REPLAYS = 7
FAIL_TOL = 1e-2  # max |gemv - linear| / max |linear|


@dataclass
class Row:
    shape: str
    n: int
    k: int
    scheme: str
    m: int
    kernel: str
    config: str
    us: float | None
    bw: float | None
    err: float | None = None
    best: bool = False


def grid(n: int, k: int, m: int, sm_count: int) -> list[GemvConfig]:
    """The configs tried for one shape: each kernel config at the heuristic's split count for
    its row tile, half and twice that (deduplicated after rounding to whole BK tiles)."""
    configs: list[GemvConfig] = []
    for block_n, block_k, warps in KERNELS[m]:
        tiles_n = -(-n // block_n)
        tiles_k = -(-k // block_k)
        auto = max(1, min(-(-4 * sm_count // tiles_n), tiles_k // 2, 16))
        splits = set()
        for want in (max(1, auto // 2), auto, min(2 * auto, tiles_k, 32)):
            splits.add(quant_gemv.split_len_splits(k, block_k, want)[1])
        configs += [GemvConfig(block_n, block_k, s, warps, 1) for s in sorted(splits)]
    default = quant_gemv.default_config(n, k, m, sm_count)
    return configs if default in configs else [default, *configs]


def time_calls(calls: list[Callable[[], object]]) -> float:
    """Median microseconds per call: a CUDA graph of CALLS_PER_GRAPH calls cycling over
    `calls` (one per weight copy), replayed REPLAYS times."""
    if not torch.cuda.is_available():  # --dry-run: wall time under the interpreter
        start = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - start) * 1e6
    reps = max(CALLS_PER_GRAPH, len(calls))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:  # warm the allocator on the side stream
            call()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.float().abs().max().item() or 1.0
    return (out.float() - ref.float()).abs().max().item() / scale


def sweep_group(name: str, n: int, k: int, scheme: str, m: int, ws: list[PackedWeight],
                configs: list[GemvConfig], sm_count: int, deadline: float) -> list[Row]:
    device = ws[0].parts["weight"].device
    gen = torch.Generator(device=device).manual_seed(m)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    x = torch.randn(m, k, device=device, generator=gen).to(dtype)
    moved = weight_bytes(ws[0]) + x.element_size() * m * (k + n)

    def row(kernel: str, config: str, us: float | None, err: float | None = None) -> Row:
        bw = None if us is None else moved / (us * 1e-6) / BANDWIDTH
        return Row(name, n, k, scheme, m, kernel, config, us, bw, err)

    ref = linear(x, ws[0])  # compiles and autotunes the current path
    rows = [row("linear", "autotuned", time_calls([lambda w=w: linear(x, w) for w in ws]))]
    ops = [_operands(w) for w in ws]
    out = torch.empty((m, n), dtype=dtype, device=device)
    default = quant_gemv.default_config(n, k, m, sm_count)
    for cfg in configs:
        label = cfg.label() + (" (default)" if cfg == default else "")
        if time.monotonic() > deadline and cfg != default:
            rows.append(row("gemv", label + " skipped: time budget", None))
            continue
        err = rel_err(quant_gemv.gemv(x, ops[0], out, **cfg.kwargs()), ref)
        us = time_calls([lambda o=o, c=cfg: quant_gemv.gemv(x, o, out, **c.kwargs())
                         for o in ops])
        rows.append(row("gemv", label, us, err))
    timed = [r for r in rows if r.us is not None and (r.err is None or r.err <= FAIL_TOL)]
    if timed:
        min(timed, key=lambda r: r.us).best = True
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| shape | N x K | scheme | M | kernel | config | us | % BW | check | best |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        us = "-" if r.us is None else f"{r.us:.1f}"
        bw = "-" if r.bw is None else f"{100 * r.bw:.1f}%"
        check = "ref" if r.err is None and r.kernel == "linear" else (
            "-" if r.err is None else f"{'FAIL ' if r.err > FAIL_TOL else ''}{r.err:.1e}")
        lines.append(f"| {r.shape} | {r.n} x {r.k} | {r.scheme} | {r.m} | {r.kernel} | "
                     f"{r.config} | {us} | {bw} | {check} | {'**best**' if r.best else ''} |")
    return "\n".join(lines)


def copies_of(scheme: str, n: int, k: int, device: str, gen: torch.Generator) -> list:
    first = random_weight(scheme, n, k, device, gen)
    copies = max(1, -(-4 * L2_BYTES // weight_bytes(first)))
    return [first] + [random_weight(scheme, n, k, device, gen) for _ in range(copies - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: one tiny shape through the Triton interpreter (plumbing only)")
    parser.add_argument("--budget-s", type=float, default=80.0,
                        help="past this many seconds only the default configs still run")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="comma-separated subset of " + ",".join(SHAPES))
    args = parser.parse_args()
    start = time.monotonic()
    if args.dry_run and not torch.cuda.is_available():
        device, sm_count = "cpu", 4
        shapes = {"tiny": (64, 512)}
        n_real = sum(len(grid(n, k, m, 132)) for n, k in SHAPES.values() for m in MS)
        kernels = {1: [(32, 256, 4)], 4: [(16, 256, 4)]}
        KERNELS.update(kernels)
        print(f"dry run on CPU: {n_real} gemv configs per scheme would run on an H200 "
              f"({sum(len(v) for v in kernels.values())} compiled kernels per scheme here)")
    elif not torch.cuda.is_available():
        sys.exit("gemv_sweep: needs a CUDA GPU (an H200); on a CPU-only machine run "
                 "`scripts/gemv_sweep.py --dry-run` to check the plumbing")
    else:
        device = "cuda"
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    deadline = start + args.budget_s
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[Row] = []
    for name, (n, k) in shapes.items():
        for scheme in SCHEMES:
            ws = copies_of(scheme, n, k, device, gen)
            for m in MS:
                configs = grid(n, k, m, sm_count)
                rows += sweep_group(name, n, k, scheme, m, ws, configs, sm_count, deadline)
                print(f"[{time.monotonic() - start:5.1f}s] {name} {scheme} M={m}: "
                      f"{len(configs)} configs", file=sys.stderr)
            del ws
            if device == "cuda":
                torch.cuda.empty_cache()
    text = table(rows)
    fails = sum(r.err is not None and r.err > FAIL_TOL for r in rows)
    text += (f"\n\n{len(rows)} rows, {fails} FAIL, {time.monotonic() - start:.0f} s "
             f"({'dry run, CPU interpreter wall times' if device == 'cpu' else device})\n")
    print(text)
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gemv_sweep.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
