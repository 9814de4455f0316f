"""Does the decode tuner pick the fastest plan, and the same one each time? (GPU, ~2 min)

The decode tuner (`tuner.tuned_plan`) times each (config, K split) candidate as
CUDA-graph replays of calls cycling through zero-filled stand-ins for the weight, its median
over rounds that take every candidate in turn (`tuner.streaming_times`), and keeps the
fastest. Its previous timing (one weight, each call behind a read of twice the L2) was
repeatable but blind on the 27B's smaller shapes, and its plans decoded 2.7% slower than the
plans this probe found fastest (docs/perf.md, twenty-fifth run).

For every 27B decode shape this prints, per candidate, the tuner's time in each of --rounds
calls of its timing (an asterisk on the candidate each picks) and the time of calls streaming
over random weight copies beyond the L2 (`ninfer-bench kernels`' measure; a plus on the
fastest), so that the tuner's pick can be compared with the best and with itself; `--m 1,5`
shows how the ranking moves with the rows (the twenty-fifth run's engine had tuned its
one-row plans at 5 rows, `quant_linear.decode_plan_rows`). With --home DIR, each shape's
streaming-fastest candidate is stored as the tuner's choice in DIR's tuning cache
(`ops.tuning_cache`), so that an engine started with NINFER_HOME=DIR decodes with those plans
(`gpu_measure.sh tprobe eng27best`):

    python3 scripts/tuner_probe.py [--rounds 3] [--schemes nvfp4] [--m 1] [--home DIR]
"""

from __future__ import annotations

import argparse
import os

import torch

from ninfer_bench.kernels.linear import _rotating, _timed, model_weights, save_table
from ninfer_runtime.ops import quant_linear as ql
from ninfer_runtime.ops import tuner, tuning_cache


def probe(label: str, ws: list, m: int, rounds: int, gen: torch.Generator, keep: bool
          ) -> list[str]:
    """The table rows of one weight shape (ws: its copies) at m activation rows; keep: store
    the streaming-fastest candidate in the tuning cache (NINFER_HOME)."""
    n, k = ws[0].shape
    ops = ql._operands(ws[0])
    x = torch.randn(m, k, device=gen.device, generator=gen).to(torch.bfloat16)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    options = ql.decode_candidates(n, k, ops.layout.scheme, x.device)

    runs = ql.decode_runs(x, ops, out)
    timed = [[t * 1e3 for t in tuner.streaming_times(options, runs)] for _ in range(rounds)]
    del runs
    key = ql._decode_key(n, k, ops.layout, x)
    streaming = []
    for plan in options:  # linear() takes the plan set for its key
        ql._decode_plans[key] = plan
        streaming.append(_timed(_rotating(ws, x)))
    del ql._decode_plans[key]
    best = streaming.index(min(streaming))
    if keep:
        tuning_cache.store(tuning_cache.cache_file(x.device),
                           tuning_cache.entry_key(key, options), best)
    rows = []
    for i, plan in enumerate(options):
        cfg = plan.config
        tuner = " / ".join(f"{r[i]:.1f}{'*' if r.index(min(r)) == i else ''}" for r in timed)
        rows.append(f"| {label} | {m} | BN={cfg.bn} s={cfg.stages} d={cfg.dots} "
                    f"splits={plan.splits} | {tuner} "
                    f"| {streaming[i]:.1f}{'+' if i == best else ''} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--schemes", default="nvfp4")
    p.add_argument("--m", default="1")
    p.add_argument("--home", help="store the streaming-fastest plans in this NINFER_HOME")
    args = p.parse_args()
    if args.home:
        os.environ["NINFER_HOME"] = args.home
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| shape | M | candidate | tuner us, each round | streaming us |",
             "|---|---|---|---|---|"]
    for shape, scheme, ws in model_weights("27B", args.schemes.split(","), "cuda", gen):
        for m in (int(v) for v in args.m.split(",")):
            lines += probe(f"{shape} {scheme}", ws, m, args.rounds, gen, bool(args.home))
        del ws  # before model_weights builds the next shape's copies
    save_table(lines, "tuner_probe.md")


if __name__ == "__main__":
    main()
