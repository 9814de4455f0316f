"""scripts/tuned_plans.py reads a tuning file back as plans: the stored index of a key whose
candidate list this tree reproduces, and a stale key (other candidates) named as such."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer_runtime.ops import quant_linear as ql
from ninfer_runtime.ops import tuning_cache

ROOT = Path(__file__).resolve().parents[1]


def test_tuned_plans_reads_back_the_stored_choice(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ql, "INTERPRET", False)  # the GPU's candidates, as the script builds
    monkeypatch.setattr(ql, "_sm_count", lambda device: 132)
    key = (5120, 6144, 8, True, ql._INT_ID, torch.bfloat16, False)
    stale = (16384, 5120, 8, True, ql._INT_ID, torch.bfloat16, False)
    plans = ql.decode_candidates(5120, 6144, ql._INT_ID, torch.device("cuda"))
    index = len(plans) - 1
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({tuning_cache.entry_key(key, plans): index,
                                tuning_cache.entry_key(stale, plans[:1]): 0}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "scripts/tuned_plans.py", str(path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True).stdout
    lines = {line.split(",")[0]: line for line in out.splitlines()}
    p = plans[index]
    assert (f"{p.config.describe()}; {p.splits} x {p.split_len}  "
            f"({index + 1} of {len(plans)})") in lines["5120 x 6144"]
    assert p.config.capped == ("capped at" in lines["5120 x 6144"])
    assert "candidates changed since" in lines["16384 x 5120"]
