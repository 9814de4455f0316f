"""Batched sampling over the real vocabulary (248,320 fp32 logits per row).

`sample_rows` (thresholds from the top candidates, then one pass over the logits that adds the
noise and keeps each chunk's best token) at 1, 8 and 64 rows for greedy, temperature-only, the
Qwen3.6 default filters (top-k 20, top-p 0.95) and top-p alone (which needs a full sort), and
`apply_penalties`. All are memory-bound: the ratio is the bytes of one read of the logits (plus
the penalty inputs and output) over the copy bandwidth. Each row also times the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer_bench.ceilings import against_bandwidth
from ninfer_runtime.ops.sampling import (
    RowSampling,
    apply_penalties,
    apply_penalties_ref,
    sample_rows,
    sample_rows_ref,
)

VOCAB = 248320
ROWS = (1, 8, 64)
# name: (temperature, top_k, top_p, min_p)
SETTINGS = {"greedy": (0.0, 0, 1.0, 0.0), "temperature": (0.7, 0, 1.0, 0.0),
            "top-k 20 top-p 0.95": (1.0, 20, 0.95, 0.0), "top-p 0.9": (0.8, 0, 0.9, 0.0)}


def _time_us(fn: Callable[[], object]) -> float:
    import triton

    fn()  # compile outside the timing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _row(op: str, shape: str, us: float, ref_us: float, moved: int) -> dict:
    return {"op": op, "shape": shape, "time_us": us, "bytes": moved,
            **against_bandwidth(moved, us), "ref_time_us": ref_us, "speedup_vs_ref": ref_us / us}


def _sample_row(name: str, logits: torch.Tensor, setting: tuple[float, int, float, float],
                device: str) -> dict:
    b = logits.shape[0]
    t, k, p, m = setting
    params = RowSampling.build([t] * b, [k] * b, [p] * b, [m] * b, list(range(b)), [0] * b,
                               VOCAB, device)
    return _row(f"sample_rows {name}", f"[{b}, {VOCAB}]",
                _time_us(lambda: sample_rows(logits, params)),
                _time_us(lambda: sample_rows_ref(logits, params)), logits.numel() * 4)


def _penalties_row(logits: torch.Tensor, device: str) -> dict:
    b = logits.shape[0]
    seen = torch.rand(b, VOCAB, device=device) < 0.01
    counts = (torch.rand(b, VOCAB, device=device) < 0.001).int()
    rep, freq, pres = (torch.full((b,), v, device=device) for v in (1.1, 0.2, 0.3))
    args = (logits, seen, counts, rep, freq, pres)
    return _row("apply_penalties", f"[{b}, {VOCAB}]", _time_us(lambda: apply_penalties(*args)),
                _time_us(lambda: apply_penalties_ref(*args)), logits.numel() * (4 + 1 + 4 + 4))


def bench(device: str = "cuda") -> list[dict]:
    """Median times of sample_rows per setting and row count, and of apply_penalties."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"the sampling kernel benchmark needs a CUDA device, not {device!r}")
    rows = []
    for b in ROWS:
        logits = torch.randn(b, VOCAB, device=device) * 4
        rows += [_sample_row(name, logits, setting, device) for name, setting in SETTINGS.items()]
        rows.append(_penalties_row(logits, device))
    return rows
