"""One 27B decode linear per decode config, for Nsight Compute to read its stall reasons.

The decode kernel reaches 28-46% of bandwidth at ~3.2 SASS instructions per weight, below the
~4.4 an H200 can issue per weight at full bandwidth (scripts/sass_report.py), so issue alone
does not explain it: ncu's warp states say what the warps wait on. Each config of
quant_linear.DECODE_CONFIGS runs once, untimed, on gate_up (34816 x 5120, nvfp4, M = 1):

    ncu --clock-control none --kernel-name regex:_decode_kernel \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis python3 scripts/ncu_decode.py [BN,BK,WARPS,STAGES,DOTS ...]

(arguments: those configs instead). The stall reasons per issued instruction:
`--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio`.
"""

from __future__ import annotations

import sys

import torch

from ninfer_bench.kernels.linear import random_weight
from ninfer_runtime.ops import quant_linear as ql


def main() -> None:
    n, k = 34816, 5120
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = random_weight("nvfp4", n, k, "cuda", gen)
    ops = ql._operands(w)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty(1, n, dtype=x.dtype, device="cuda")
    configs = [ql.DecodeConfig(*map(int, a.split(","))) for a in sys.argv[1:]] \
        or ql.DECODE_CONFIGS[ops.layout.scheme]
    for config in configs:
        split_len, splits = ql.k_split(n, k, x.device)
        ql._run_decode(x, ops, out, ql.DecodePlan(config, split_len, splits))
        print(config, flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
