"""The decode plans a tuning file holds, read back as configs and K splits, without a GPU.

The tuner stores each dense decode key's choice as an index into its candidate list, under a
digest of that list (`ops.tuning_cache`). This rebuilds the candidate lists of this tree for
a GPU of `--sms` SMs (132: H100 SXM and H200) and prints, for every key whose digest this
tree reproduces, the plan the index names; a key whose candidates have changed since is
listed as such (its plan would be tuned again). The MoE stages' keys are skipped.

    .venv/bin/python scripts/tuned_plans.py ab/tuning/NVIDIA-H100-80GB-HBM3-triton3.6.0.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the GPU's candidate lists, not the interpreter's

import torch  # noqa: E402

from ninfer_runtime.ops import quant_linear as ql  # noqa: E402
from ninfer_runtime.ops import tuning_cache  # noqa: E402

SCHEMES = {ql._NVFP4_ID: "nvfp4", ql._INT_ID: "groupwise-int"}


def parse(entry: str) -> tuple[tuple, str]:
    """(key with torch dtypes, digest) of a stored entry."""
    plain, digest = entry.rsplit("#", 1)
    fields = ast.literal_eval(plain.replace("torch.bfloat16", "'bfloat16'")
                              .replace("torch.float16", "'float16'"))
    return tuple(getattr(torch, v) if v in ("bfloat16", "float16") else v
                 for v in fields), digest


def plan_of(key: tuple, digest: str, index: int) -> str | None:
    """The plan `index` names for a dense decode key, or None where this tree's candidates
    do not give the stored digest."""
    n, k, _, _, scheme = key[:5]
    launched_as = key[7] if len(key) > 7 else None
    plans = ql.launch_candidates(n, k, scheme, torch.device("cuda"), launched_as)
    if tuning_cache.entry_key(key, plans).rsplit("#", 1)[1] != digest:
        return None
    p = plans[index]
    return f"{p.config.describe()}; {p.splits} x {p.split_len}  ({index + 1} of {len(plans)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tuning", help="a tuning JSON file ($NINFER_HOME/tuning/*.json)")
    parser.add_argument("--sms", type=int, default=132, help="the GPU's SM count")
    args = parser.parse_args()
    ql.INTERPRET = False
    ql._sm_count = lambda device: args.sms
    entries = json.loads(Path(args.tuning).read_text())
    print("weight N x K, rows (one-row plan), scheme -> plan")
    for entry, index in sorted(entries.items()):
        key, digest = parse(entry)
        if type(key[3]) is not bool:  # a dense key's one-row flag; an MoE stage's K
            continue
        plan = plan_of(key, digest, index)
        head = f"{key[0]} x {key[1]}, {key[2]} ({key[3]}), {SCHEMES[key[4]]}"
        print(f"{head:<44} -> {plan or 'candidates changed since: tuned again'}")


if __name__ == "__main__":
    sys.exit(main())
